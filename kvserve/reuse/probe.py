"""Attention probes: the attention mass some rows of a step put on every earlier position of their
sequence, at one layer, measured beside the real attention (which they do not change).

Query-aware repair (reuse/repair.py, strategy `query`) probes the request's question: its rows,
computed through the first layers, read the moved KV of the reused tokens; the tokens they attend to
most are the ones worth recomputing. A probe is handed to the model runner on a ScheduledSeq; the
runner sets its first row in the packed step and wraps the step's backend in ProbingBackend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import LayerKV

ROWS_PER_CHUNK = 16  # probe rows scored at once: bounds the [heads, rows, context] logits


@dataclass
class AttentionProbe:
    layer: int  # the decoder layer whose attention is measured
    rows: list[int]  # indices into the item's rows (ScheduledSeq.positions) of the probed rows
    positions: torch.Tensor  # [R] int64: their positions in the sequence
    context_slots: torch.Tensor  # [n] int64: pool slots of positions [0, n), n > max(positions)
    mass: torch.Tensor  # [n] float32: accumulated sum over heads and probed rows of softmax weights
    first_row: int = -1  # the item's first row in the packed step (ModelRunner.prepare_inputs)

    def observe(self, query: torch.Tensor, kv: LayerKV, scale: float) -> None:
        """query [T, H, D]: the step's queries at self.layer (after RoPE). Adds each probed row's
        causal softmax over positions [0, n) to `mass` (float32, summed over heads)."""
        assert self.first_row >= 0, "the model runner sets first_row"
        k = kv.read_slots(self.context_slots)[0].float()  # [n, H_kv, D]
        heads, kv_heads = query.shape[1], k.shape[1]
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        n = k.shape[0]
        context = torch.arange(n, device=k.device)
        rows = torch.tensor(self.rows, dtype=torch.long, device=query.device) + self.first_row
        for start in range(0, len(self.rows), ROWS_PER_CHUNK):
            q = query.index_select(0, rows[start : start + ROWS_PER_CHUNK]).float()  # [r, H, D]
            logits = torch.einsum("rhd,nhd->hrn", q, k) * scale
            hidden = context[None, :] > self.positions[start : start + ROWS_PER_CHUNK, None].to(k.device)
            logits.masked_fill_(hidden[None], float("-inf"))
            self.mass += torch.softmax(logits, dim=-1).sum(dim=(0, 1)).to(self.mass.device)


class ProbingBackend(AttentionBackend):
    """The step's backend, plus the probes of its layers (called after the real attention)."""

    def __init__(self, inner: AttentionBackend, layers: list[LayerKV], probes: list[AttentionProbe]):
        self.inner = inner
        self.name = inner.name
        self.by_layer: dict[int, list[AttentionProbe]] = {}
        for p in probes:
            self.by_layer.setdefault(id(layers[p.layer]), []).append(p)

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        assert not window, "attention probes measure full-attention layers only (content reuse)"
        out = self.inner.forward(query, kv, meta, scale)
        for probe in self.by_layer.get(id(kv), []):
            probe.observe(query, kv, scale)
        return out

    def handles_positions(self, head_dim: int) -> bool:
        return self.inner.handles_positions(head_dim)
