"""Triton prefill / chunked-prefill attention over a paged KV pool (FlashAttention-2 loop).

Grid (query tiles of BLOCK_M rows, num_seqs, num_heads). A program loads its query tile once, walks
the sequence's KV in tiles of BLOCK_N tokens through the block table with an online softmax in
fp32 (exp2, scale folded with log2(e)), and stops at the last KV position its last row can see.
Causal mask aligned bottom-right: query row j of a sequence with q_len rows and seq_len KV tokens
sees positions [0, seq_len - q_len + j], and in a sliding-window layer only the last `window` of them
(the loop then starts at the first row's window). Decode rows (q_len == 1) are valid input too. Dense pools
and fp8_e4m3 pools (uint8 codes, one fp32 scale per slot and KV head, as paged_decode reads them)
are read in place.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvserve.kernels.checks import check_paged_args, check_scales
from kvserve.kernels.triton.common import LOG2E, dot_fp32
from kvserve.kernels.triton.kv_formats import e4m3_native_to_fp16, e4m3_to_fp16, e4m3_to_fp32, native_fp8
from kvserve.kernels.triton.reductions import reduce_max, reduce_sum

# FP8_CONVERT 0, 1, 2: e4m3_to_fp16 (integer bits), e4m3_native_to_fp16 (the hardware cvt), e4m3_to_fp32
FP8_CONVERTS = ("bits", "native", "fp32")


@triton.jit
def fp8_values(codes, FP8_CONVERT: tl.constexpr):
    if FP8_CONVERT == 1:
        return e4m3_native_to_fp16(codes)
    elif FP8_CONVERT == 2:
        return e4m3_to_fp32(codes)
    else:
        return e4m3_to_fp16(codes)


@triton.jit
def paged_prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D]: query dtype, or uint8 fp8 codes (FP8_KV)
    v_cache_ptr,
    k_scale_ptr,  # FP8_KV: [num_blocks, BLOCK_SIZE, H_kv] fp32 (else any pointer, never read)
    v_scale_ptr,
    out_ptr,  # [T, H, D]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    window,  # WINDOWED: a row at position p sees (p - window, p]
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
    stride_sb,  # FP8_KV: the scales' block and slot strides (the head stride is 1)
    stride_st,
    GROUP: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # bf16 tl.dot is wrong in the CPU interpreter (triton 3.9): upcast there
    FP8_KV: tl.constexpr,
    FP8_CONVERT: tl.constexpr,  # FP8_KV: 0 integer bits to fp16, 1 the hardware cvt to fp16, 2 integer bits to fp32
    WINDOWED: tl.constexpr,  # a sliding-window layer: the loop starts at the first row's window
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
    kv_start = 0
    if WINDOWED:  # tiles wholly before the first row's window are never read
        kv_start = tl.maximum(ctx_len + m_tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)  # [N, D]
        if FP8_KV:
            k = fp8_values(k, FP8_CONVERT).to(q.dtype)  # exact in fp16 / bf16 / fp32
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N] fp32, log2 units
        if FP8_KV:
            scale_rows = block_ids * stride_sb + in_block * stride_st + kv_head
            s = s * tl.load(k_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        visible = (offs_n[None, :] <= ctx_len + offs_m[:, None]) & n_ok[None, :]
        if WINDOWED:
            visible = visible & (offs_n[None, :] > ctx_len + offs_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1))  # finite without a window: every row sees position 0
        m_use = m_new
        if WINDOWED:  # a row whose window starts past this tile has seen nothing yet: p and alpha are 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if FP8_KV:
            v = fp8_values(v, FP8_CONVERT).to(q.dtype)
        if FP8_KV:  # the V scale goes on p after l_i took it, as in paged_decode
            p = p * tl.load(v_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if WINDOWED:  # a padding row past the sequence may see nothing (0 / 0): it is never stored
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
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
    k_scale: torch.Tensor | None = None,  # given: an fp8_e4m3 pool, [num_blocks, block_size, H_kv] fp32
    v_scale: torch.Tensor | None = None,
    fp8_convert: str | None = None,  # fp8: one of FP8_CONVERTS; None = "native" where native_fp8, else "bits"
    num_warps: int = 4,
    num_stages: int | None = None,  # None: Triton's default
    window: int | None = None,  # a sliding-window layer: a row at position p sees (p - window, p]
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Launches paged_prefill_kernel on the current stream after checking every argument. The tile
    shape, warps, stages and fp8 conversion are the launch's (scripts/gpu/sweep_prefill.py measures
    them on a GPU)."""
    fp8 = k_scale is not None or v_scale is not None
    shape = check_paged_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        kv_dtype=torch.uint8 if fp8 else None,
    )
    if fp8:
        check_scales(k_scale, v_scale, k_cache)
    out = torch.empty_like(query)
    if shape.num_seqs == 0 or query.shape[0] == 0:
        return out
    scales = (k_scale, v_scale) if fp8 else (out, out)  # pointers the dense variant never reads
    scale_strides = k_scale.stride()[:2] if k_scale is not None else (0, 0)
    if fp8_convert is None:
        fp8_convert = "native" if fp8 and native_fp8(query.device) else "bits"
    if fp8_convert not in FP8_CONVERTS:
        raise ValueError(f"fp8_convert must be one of {FP8_CONVERTS}, got {fp8_convert!r}")
    options = {} if num_stages is None else {"num_stages": num_stages}
    grid = (math.ceil(max_query_len / block_m), shape.num_seqs, shape.num_heads)
    paged_prefill_kernel[grid](
        query, k_cache, v_cache, *scales, out, block_tables, query_start_loc, seq_lens, scale * LOG2E,
        int(window or 0), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *scale_strides,
        GROUP=shape.num_heads // shape.num_kv_heads, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=dot_fp32(query), FP8_KV=fp8,
        FP8_CONVERT=FP8_CONVERTS.index(fp8_convert), WINDOWED=bool(window), num_warps=num_warps, **options,
    )  # fmt: skip
    return out
