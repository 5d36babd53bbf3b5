"""Triton split-KV decode attention (flash-decoding) over a paged KV pool, GQA-aware.

Pass 1, grid (num_seqs, num_kv_heads, num_splits): a program takes one sequence's single query
row for all GROUP query heads that share a KV head (padded to GROUP_PAD >= 16 rows so tl.dot maps
to tensor cores), so each K/V tile is read once per KV head, not once per query head. It covers KV
tokens [split * tokens_per_split, ...) and writes an unnormalised-free partial (o / l, log2-sum-exp).
Pass 2, grid (num_seqs, num_heads): merges the splits exactly. Empty splits write lse = -inf.

FP8_KV reads the fp8_e4m3 pool of kvserve/quant/fp8.py directly: codes uint8 [num_blocks,
block_size, H_kv, D] and one fp32 scale per (slot, kv head). Codes convert exactly to fp16/bf16 for
tl.dot; the K scale multiplies the scores of its token, the V scale the probabilities of its token,
so no dequantized tile is ever built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.checks import check_paged_args, check_scales
from kvserve.kernels.triton.common import LOG2E, dot_fp32
from kvserve.kernels.triton.reductions import reduce_max, reduce_sum


@triton.jit
def e4m3_to_fp16(codes):
    """fp8 e4m3fn bit patterns (uint8) -> exact fp16 with integer ops, on every arch (sm_80 has no
    fp8 type): sign to bit 15, exponent|mantissa to bits 7..13, then x 2^8 for the bias 7 -> 15.
    Subnormals land on fp16 subnormals and come out exact too; NaN codes (never written) do not."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def paged_decode_split_kernel(
    q_ptr,  # [T, H, D], row query_start_loc[seq] is the sequence's query
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D], query dtype or fp8 codes (uint8)
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, H_kv] fp32 (FP8_KV only)
    v_scale_ptr,
    o_part_ptr,  # [num_seqs, H, num_splits, D] fp32
    lse_part_ptr,  # [num_seqs, H, num_splits] fp32, log2 units
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,  # multiple of BLOCK_N
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_sb,  # scale strides (FP8_KV only)
    stride_st,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    part_rows = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [GROUP_PAD]
    split_start = split * tokens_per_split
    split_end = tl.minimum(seq_len, split_start + tokens_per_split)

    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < split_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if FP8_KV:
            k = e4m3_to_fp16(k).to(q.dtype)  # exact in fp16 / bf16 / fp32
            v = e4m3_to_fp16(v).to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, N]
        if FP8_KV:
            scale_rows = block_ids * stride_sb + in_block * stride_st + kv_head
            s = s * tl.load(k_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1))  # finite: the loop only runs on non-empty tiles
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        if FP8_KV:
            p = p * tl.load(v_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0  # the split starts past seq_len
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(lse_part_ptr + part_rows, lse, mask=g_ok)
    tl.store(o_part_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])


@triton.jit
def merge_splits_kernel(
    o_part_ptr,  # [num_seqs, H, num_splits, D] fp32
    lse_part_ptr,  # [num_seqs, H, num_splits] fp32
    out_ptr,  # [T, H, D]
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    rows = (seq * num_heads + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(lse_part_ptr + rows, mask=s_ok, other=float("-inf"))
    weights = tl.math.exp2(lse - reduce_max(lse, 0))  # split 0 is never empty, so the max is finite
    o = tl.load(o_part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    merged = reduce_sum(o * weights[:, None], 0) / reduce_sum(weights, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty))


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, target_programs: int
) -> tuple[int, int]:
    """(num_splits, tokens_per_split): enough programs to fill the device, each >= one BLOCK_N tile."""
    max_tiles = max(1, triton.cdiv(max_seq_len, block_n))
    num_splits = min(max_tiles, max(1, triton.cdiv(target_programs, num_seqs * num_kv_heads)))
    tokens_per_split = triton.cdiv(max_tiles, num_splits) * block_n
    return triton.cdiv(max(max_seq_len, 1), tokens_per_split), tokens_per_split


def paged_decode(
    query: torch.Tensor,  # [T, H, D], one row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], query dtype or uint8 fp8 codes
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, H_kv] fp32: caches hold fp8 codes
    v_scale: torch.Tensor | None = None,
    block_n: int = 64,
    target_programs: int = 264,
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Launches the split pass and the merge pass on the current stream after checking arguments.

    Every sequence must have exactly one query row (pure decode); use paged_prefill otherwise.
    """
    fp8 = k_scale is not None
    shape = check_paged_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        kv_dtype=torch.uint8 if fp8 else None,
    )
    if query.shape[0] != shape.num_seqs:
        raise ValueError(
            f"paged_decode needs one query row per sequence: {query.shape[0]} rows, {shape.num_seqs} seqs"
        )
    if fp8:
        check_scales(k_scale, v_scale, k_cache)
    out = torch.empty_like(query)
    if shape.num_seqs == 0:
        return out
    group = shape.num_heads // shape.num_kv_heads
    num_splits, tokens_per_split = plan_splits(
        shape.num_seqs, shape.num_kv_heads, max_seq_len, block_n, target_programs
    )
    o_part = torch.empty(
        shape.num_seqs, shape.num_heads, num_splits, shape.head_dim, dtype=torch.float32, device=query.device
    )
    lse_part = torch.empty(
        shape.num_seqs, shape.num_heads, num_splits, dtype=torch.float32, device=query.device
    )
    k_scale_arg, v_scale_arg = (k_scale, v_scale) if fp8 else (o_part, o_part)  # unused without FP8_KV
    paged_decode_split_kernel[(shape.num_seqs, shape.num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale_arg, v_scale_arg, o_part, lse_part, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, tokens_per_split,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), k_scale_arg.stride(0), k_scale_arg.stride(1), shape.num_heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=shape.head_dim,
        BLOCK_SIZE=shape.block_size, BLOCK_N=block_n, DOT_FP32=dot_fp32(query), FP8_KV=fp8,
    )  # fmt: skip
    merge_splits_kernel[(shape.num_seqs, shape.num_heads)](
        o_part, lse_part, out, query_start_loc, out.stride(0), out.stride(1), shape.num_heads, num_splits,
        HEAD_DIM=shape.head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
    )  # fmt: skip
    return out
