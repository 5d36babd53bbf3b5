"""What a kernel reads of a layer's pool in place (kvserve/kvcache/kernel_view.py, re-exported).

`paged_kv(kv, dtype)` is `kv.kernel_view(dtype)`: each LayerKV describes its own tensors, so this
package does not reach into storage internals.
"""

from __future__ import annotations

import torch

from kvserve.kvcache.kernel_view import PagedKV
from kvserve.kvcache.kv_storage import LayerKV

__all__ = ["PagedKV", "paged_kv"]


def paged_kv(kv: LayerKV, dtype: torch.dtype | None = None) -> PagedKV | None:
    """`kv` as kernels read it in place, or None (see LayerKV.kernel_view)."""
    return kv.kernel_view(dtype)
