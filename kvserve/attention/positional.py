"""Attention for query rows at arbitrary positions (partial forwards of content-reuse repair).

One sequence per call; row i at position query_positions[i] attends to KV positions [0, p_i].
Torch SDPA with an explicit mask: runs on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import LayerKV


class PositionalBackend(AttentionBackend):
    name = "positional"

    def forward(
        self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert meta.query_positions is not None and meta.num_seqs == 1
        seq_len = meta.seq_lens_list[0]
        num_blocks = -(-seq_len // meta.block_size)
        k, v = kv.gather(meta.block_tables[0, :num_blocks].long())
        k = k.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1)  # [H_kv, S, D]
        v = v.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1)
        q = query.transpose(0, 1)  # [H, T, D]
        positions = meta.query_positions.to(query.device)
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
