"""The forward context: the one piece of module-level mutable state (style.md).

The model runner enters it around each model forward; kvserve's Cache object and attention function
(models/hf_adapter.py) read the step's KV storage, attention backend and metadata from it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import LayerKV


@dataclass
class ForwardContext:
    layers: list[LayerKV]
    backend: AttentionBackend
    meta: AttentionMetadata
    # per layer, its layer group's metadata (kvcache/layout.py); None: one group, `meta` for every layer
    layer_metas: list[AttentionMetadata] | None = None

    def meta_of(self, layer_idx: int) -> AttentionMetadata:
        return self.meta if self.layer_metas is None else self.layer_metas[layer_idx]


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "kvserve attention called outside a forward context"
    return _current
