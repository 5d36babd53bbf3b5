"""Paged attention on CPU directly over the block table, without gathering the whole history.

Per sequence (q_len new tokens at the end of seq_len tokens of KV) the KV range is cut into
segments that never straddle `ctx_len`:

  [0, ctx_len)         context: every query row sees all of it, no mask
  [ctx_len, seq_len)   the new tokens: query row j sees [ctx_len, ctx_len + j]

ctx_len = seq_len - q_len, or seq_len for a decode row (it sees everything). Once the rows that
see nothing of a new-token segment are cut off, its mask is top-left causal, so every segment runs
torch's CPU flash-attention kernel with is_causal in {False, True} and no mask tensor.

Segments are also cut where the block table breaks: a run of consecutive block ids is a strided
view of a dense pool (no copy). Runs shorter than MIN_VIEW_BLOCKS are gathered in groups of up to
GATHER_TOKENS tokens (a copy small enough to stay in cache). Partial results are merged exactly
through their log-sum-exp (the flash-decoding merge).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV

MIN_VIEW_BLOCKS = 4  # shorter runs of consecutive blocks are gathered instead of viewed
GATHER_TOKENS = 2048  # at most this many tokens per gathered segment

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids: [(index of the run's first entry, run length)]."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


def _segments(
    kv: LayerKV, block_ids: torch.Tensor, seq_len: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields (first token position, K, V) covering [0, seq_len) in order; K/V [n, H_kv, D]."""
    bs, h_kv, d = kv.block_size, kv.num_kv_heads, kv.head_dim
    dense = isinstance(kv, DenseLayerKV)
    first, count = 0, 0  # table entries [first, first + count) wait to be gathered together

    def gathered() -> tuple[int, torch.Tensor, torch.Tensor]:
        k, v = kv.gather(block_ids[first : first + count].long())  # [count, bs, H_kv, D]
        n_tok = min(count * bs, seq_len - first * bs)
        return first * bs, k.view(-1, h_kv, d)[:n_tok], v.view(-1, h_kv, d)[:n_tok]

    for start, length in block_runs(block_ids.tolist()):
        if dense and length >= MIN_VIEW_BLOCKS:
            if count:
                yield gathered()
                count = 0
            b0 = int(block_ids[start])
            n_tok = min(length * bs, seq_len - start * bs)
            k = kv.k_cache[b0 : b0 + length].view(-1, h_kv, d)[:n_tok]
            v = kv.v_cache[b0 : b0 + length].view(-1, h_kv, d)[:n_tok]
            yield start * bs, k, v
            continue
        for index in range(start, start + length):
            if count == 0:
                first = index
            count += 1
            if count * bs >= GATHER_TOKENS:
                yield gathered()
                count = 0
    if count:
        yield gathered()


def _split_at(
    segments: Iterator[tuple[int, torch.Tensor, torch.Tensor]], pos: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Cuts the one segment that straddles token position `pos` in two."""
    for start, k, v in segments:
        end = start + k.shape[0]
        if start < pos < end:
            yield start, k[: pos - start], v[: pos - start]
            yield pos, k[pos - start :], v[pos - start :]
        else:
            yield start, k, v


def _merge(o_acc, lse_acc, o_new, lse_new) -> None:
    """In place: (o_acc, lse_acc) <- softmax-weighted union of the two partial results.

    o [H, rows, D] float32, lse [H, rows] float32; lse_acc is finite (first segment covers all rows).
    """
    lse_max = torch.maximum(lse_acc, lse_new)
    w_acc = torch.exp(lse_acc - lse_max)
    w_new = torch.exp(lse_new - lse_max)
    total = w_acc + w_new
    o_acc.mul_((w_acc / total).unsqueeze(-1)).add_(o_new * (w_new / total).unsqueeze(-1))
    lse_acc.copy_(lse_max + torch.log(total))


def attention_one_sequence(
    q: torch.Tensor,  # [q_len, H, D]
    kv: LayerKV,
    block_ids: torch.Tensor,  # [num_blocks] int, the sequence's blocks in order
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, H, D]
    q_len = q.shape[0]
    ctx_len = seq_len if q_len == 1 else seq_len - q_len
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D] view
    o_acc = lse_acc = None
    for start, k, v in _split_at(_segments(kv, block_ids, seq_len), ctx_len):
        first_row = max(0, start - ctx_len)  # rows before it see nothing of a new-token segment
        k4 = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, H_kv, n, D] view (dense pools)
        v4 = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o, lse = _flash_cpu(qh[:, :, first_row:], k4, v4, is_causal=start >= ctx_len, scale=scale)
        if o_acc is None:
            if start + k.shape[0] >= seq_len:
                return o[0].transpose(0, 1)  # one segment: no merge
            o_acc, lse_acc = o[0].float(), lse[0].clone()  # [H, q_len, D], [H, q_len]
            continue
        _merge(o_acc[:, first_row:], lse_acc[:, first_row:], o[0].float(), lse[0])
    assert o_acc is not None, "seq_len must be >= 1"
    return o_acc.transpose(0, 1).to(q.dtype)


class CpuPagedBackend(AttentionBackend):
    """cpu_paged: CPU flash attention per sequence over views of the paged pool (see module doc)."""

    name = "cpu_paged"

    def forward(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
            num_blocks = -(-seq_len // meta.block_size)
            block_ids = meta.block_tables[i, :num_blocks]
            out[start : start + q_len] = attention_one_sequence(
                query[start : start + q_len], kv, block_ids, seq_len, scale
            )
            start += q_len
        return out
