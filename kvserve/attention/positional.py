"""Attention for batches with rows at explicit positions (content-reuse repair rows beside ordinary ones)
on backends that do not take positions themselves.

Row i at position query_positions[i] attends to KV positions [0, p_i]. On CPU with the C++ extension:
the batch-invariant paged kernel of cpu_paged, which takes explicit positions, so a row recomputed
here is bitwise the row an exact-prefix prefill computes. Elsewhere (GPUs, no compiler, a head_dim
the extension lacks): torch SDPA per sequence over a gathered copy with an explicit mask (correct,
and slower than the GPU kernels the same batch would otherwise use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.cpu_paged import extension_attention
from kvserve.kernels import cpu_ext
from kvserve.kvcache.kv_storage import LayerKV


class PositionalBackend(AttentionBackend):
    name = "positional"

    def __init__(self, use_extension: bool = True):
        self.use_extension = use_extension

    def handles_positions(self, head_dim: int) -> bool:
        return True

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        assert not window, f"{self.name} takes no sliding window (takes_window is False)"
        assert meta.query_positions is not None
        if self.use_extension and query.device.type == "cpu" and kv.head_dim in cpu_ext.HEAD_DIMS:
            ext = cpu_ext.load_or_none()  # built once per process, on the first CPU call
            if ext is not None:
                return extension_attention(ext, query, kv, meta, scale)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_list):
            a, b = starts[i], starts[i + 1]
            positions = meta.query_positions[a:b]
            out[a:b] = sdpa_attention(query[a:b], kv, meta.block_tables[i], seq_len, positions, scale)
        return out


def sdpa_attention(
    query: torch.Tensor,  # [T, H, D]
    kv: LayerKV,
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    positions: torch.Tensor,  # [T] int64
    scale: float,
) -> torch.Tensor:
    """Gathered K/V and one SDPA call with an explicit mask (or plain causal when every position is a row)."""
    num_blocks = -(-seq_len // kv.block_size)
    k, v = kv.gather(block_table[:num_blocks].long())
    k = k.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1)  # [H_kv, S, D]
    v = v.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1)
    q = query.transpose(0, 1)  # [H, T, D]
    positions = positions.to(query.device)
    mask: torch.Tensor | None = None
    if positions.numel() != seq_len:  # rows at chosen positions: explicit mask
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= positions.unsqueeze(1)  # [T, S]
    # else every position [0, seq_len) is a row, in order: plain causal (the flash path)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0).to(q.dtype),
        v.unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
