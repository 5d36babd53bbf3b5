"""Triton prefill / chunked-prefill attention over a paged KV pool (FlashAttention-2 loop).

Grid (query tiles of BLOCK_M rows, num_seqs, num_heads). A program loads its query tile once, walks
the sequence's KV in tiles of BLOCK_N tokens through the block table with an online softmax in
fp32 (exp2, scale folded with log2(e)), and stops at the last KV position its last row can see.
Causal mask aligned bottom-right: query row j of a sequence with q_len rows and seq_len KV tokens
sees positions [0, seq_len - q_len + j]. Decode rows (q_len == 1) are valid input too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvserve.kernels.checks import check_paged_args
from kvserve.kernels.triton.common import LOG2E, dot_fp32
from kvserve.kernels.triton.reductions import reduce_max, reduce_sum


@triton.jit
def paged_prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # bf16 tl.dot is wrong in the CPU interpreter (triton 3.9): upcast there
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    kv_end = ctx_len + tl.minimum(q_len, (m_tile + 1) * BLOCK_M)  # last row's horizon, exclusive
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)  # [N, D]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N] fp32, log2 units
        visible = (offs_n[None, :] <= ctx_len + offs_m[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1))  # finite: every row sees position 0 in the first tile
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    out = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Launches paged_prefill_kernel on the current stream after checking every argument."""
    shape = check_paged_args(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(query)
    if shape.num_seqs == 0 or query.shape[0] == 0:
        return out
    grid = (math.ceil(max_query_len / block_m), shape.num_seqs, shape.num_heads)
    paged_prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=shape.num_heads // shape.num_kv_heads, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=dot_fp32(query),
    )  # fmt: skip
    return out
