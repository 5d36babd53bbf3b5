"""Plain-torch reference attention: the oracle every other backend is tested against.

Per sequence: gather its blocks, cut to seq_len, expand KV heads for GQA, explicit bottom-right
causal mask (and a sliding-window layer's lower edge), softmax in float64 (float32 inputs) or
float32. Slow and obviously right.
"""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import LayerKV


def attention_one_sequence(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [seq_len, H_kv, D]
    v: torch.Tensor,  # [seq_len, H_kv, D]
    scale: float,
    window: int | None = None,  # a row at position p sees (p - window, p]
) -> torch.Tensor:  # [q_len, H, D]
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    acc = torch.float64 if q.dtype == torch.float32 else torch.float32
    group = num_heads // num_kv_heads
    k = k.to(acc).repeat_interleave(group, dim=1)  # [seq_len, H, D]
    v = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k) * scale  # [H, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    takes_window = True

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            num_blocks = -(-seq_len // meta.block_size)
            block_ids = meta.block_tables[i, :num_blocks].long()
            k, v = kv.gather(block_ids)  # [n, block_size, H_kv, D]
            k = k.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len]
            v = v.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len]
            out[start : start + q_len] = attention_one_sequence(
                query[start : start + q_len], k, v, scale, window
            )
            start += q_len
        return out

    @classmethod
    def is_available(
        cls, device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """Plain torch ops: any device, head_dim and dtype (slow: the last resort of `auto`)."""
        return True, ""
