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

INT8_KV reads the int8 KIVI pool of kvserve/quant/kivi.py (QuantizedLayerKV) directly. K codes are
per channel over a block (scale, zero fp16 [num_blocks, H_kv, D]), V codes per token with one scale
and zero per V_GROUP channels (fp16 [num_blocks, BLOCK_SIZE, H_kv, D // V_GROUP]). A K tile spans
several blocks and a V row several groups, so neither affine folds into one dot: both tiles are
dequantized in registers, code * scale + zero in fp32 rounded to the query dtype, which is exactly
what QuantizedLayerKV.gather hands the reference. The K of an open block (not yet full, so not yet
quantized) is read from its full-precision shadow, k_open[slot_of_block[block]] (OpenKeyShadows),
chosen per token: slot >= 0 reads the shadow, -1 the codes; both loads are masked, so each token
costs only the bytes it uses.

MXFP4_KV reads the mxfp4 pool of kvserve/quant/fp4.py (OCP MX, QuantizedLayerKV) directly: codes
uint8 [num_blocks, BLOCK_SIZE, H_kv, D // 2], byte b of a row holding channel 2b in its low nibble
and 2b + 1 in its high one (bitpack.pack_bits), each code E2M1 (sign << 3 | exponent << 1 |
mantissa); scales uint8 [num_blocks, BLOCK_SIZE, H_kv, D // 32], one UE8M0 exponent e per token and
group of 32 channels, worth 2^(e - 127). Like int8's, the scale varies along the channels of a row,
so both tiles are dequantized in registers: codes to fp16 and exponents to fp32 with integer bit
operations, their product in fp32 (exact) rounded once to the compute dtype, bit for bit what
QuantizedLayerKV.gather hands the reference. A token costs D / 2 + D / 32 bytes per KV head for K
and again for V, 0.27x the bytes of fp16 / bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.checks import check_int8_fields, check_paged_args, check_scales
from kvserve.kernels.triton.common import LOG2E, dot_fp32
from kvserve.kernels.triton.kv_formats import (
    MXFP4_BLOCK_N,
    e4m3_native_to_fp16,
    e4m3_to_fp16,
    int8_kivi_k,
    int8_kivi_v,
    mxfp4_tile,
    native_fp8,
)
from kvserve.kernels.triton.reductions import reduce_max, reduce_sum


@triton.jit
def paged_decode_split_kernel(
    q_ptr,  # [T, H, D], row query_start_loc[seq] is the sequence's query
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D], query dtype, or uint8 codes (FP8_KV, INT8_KV;
    v_cache_ptr,  # MXFP4_KV: [num_blocks, BLOCK_SIZE, H_kv, D // 2], two codes a byte)
    k_scale_ptr,  # FP8_KV: [num_blocks, BLOCK_SIZE, H_kv] fp32; INT8_KV: [num_blocks, H_kv, D] fp16;
    # MXFP4_KV: [num_blocks, BLOCK_SIZE, H_kv, D // 32] uint8 UE8M0 exponents
    v_scale_ptr,  # FP8_KV, MXFP4_KV: like k_scale; INT8_KV: [num_blocks, BLOCK_SIZE, H_kv, D // V_GROUP] fp16
    k_zero_ptr,  # INT8_KV only: like k_scale
    v_zero_ptr,  # INT8_KV only: like v_scale
    k_open_ptr,  # INT8_KV only: [capacity, BLOCK_SIZE, H_kv, D] query dtype, K of the open blocks
    k_open_slot_ptr,  # INT8_KV only: [num_blocks] int32, row of k_open or -1 (closed: read codes)
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
    stride_sb,  # per-token scale strides (FP8_KV, MXFP4_KV: both scales; INT8_KV: v_scale and v_zero)
    stride_st,
    stride_sh,
    stride_ksb,  # INT8_KV: k_scale and k_zero strides (channels contiguous)
    stride_ksh,
    stride_ob,  # INT8_KV: k_open strides
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,
    INT8_KV: tl.constexpr,
    MXFP4_KV: tl.constexpr,
    NATIVE_FP8: tl.constexpr,  # FP8_KV: decode codes with the hardware conversion (native_fp8)
    V_GROUP: tl.constexpr,  # INT8_KV: channels per V scale / zero
    TILE_BLOCKS: tl.constexpr,  # INT8_KV: blocks a BLOCK_N tile touches, max(1, BLOCK_N // BLOCK_SIZE)
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
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        scale_rows = block_ids * stride_sb + in_block * stride_st + kv_head * stride_sh
        if INT8_KV:  # V is dequantized after the softmax, so the two tiles are not live together
            k = int8_kivi_k(
                k_cache_ptr, k_scale_ptr, k_zero_ptr, k_open_ptr, k_open_slot_ptr, table, start_n, split_end,
                block_ids, in_block, kv_head, k_rows, n_ok, offs_d, stride_ksb, stride_ksh, stride_ob,
                stride_ot, stride_oh, BLOCK_SIZE, BLOCK_N, TILE_BLOCKS, HEAD_DIM,
            )  # fmt: skip
        elif MXFP4_KV:  # V likewise after the softmax
            k = mxfp4_tile(
                k_cache_ptr, k_scale_ptr, k_rows, scale_rows, n_ok, q_ptr.dtype.element_ty, BLOCK_N, HEAD_DIM
            )
        else:
            k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if FP8_KV and NATIVE_FP8:
            k = e4m3_native_to_fp16(k).to(q.dtype)  # exact in fp16 / bf16 / fp32
            v = e4m3_native_to_fp16(v).to(q.dtype)
        elif FP8_KV:
            k = e4m3_to_fp16(k).to(q.dtype)
            v = e4m3_to_fp16(v).to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, N]
        if FP8_KV:
            s = s * tl.load(k_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1))  # finite: the loop only runs on non-empty tiles
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        if FP8_KV:
            p = p * tl.load(v_scale_ptr + scale_rows, mask=n_ok, other=0.0)[None, :]
        if INT8_KV:
            v = int8_kivi_v(
                v_cache_ptr, v_scale_ptr, v_zero_ptr, v_rows, scale_rows, n_ok, offs_d,
                q_ptr.dtype.element_ty, BLOCK_N, HEAD_DIM, V_GROUP,
            )  # fmt: skip
        if MXFP4_KV:
            v = mxfp4_tile(
                v_cache_ptr, v_scale_ptr, v_rows, scale_rows, n_ok, q_ptr.dtype.element_ty, BLOCK_N, HEAD_DIM
            )
        if DOT_FP32:
            v = v.to(tl.float32)
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


INT8_BLOCK_N, INT8_NUM_WARPS = 32, 8  # int8 KIVI launch defaults (see paged_decode)
# fp8 tiles of 128 tokens: on an H200 (scripts/gpu/sweep_decode.py, docs/kernels.md) 0.275 against
# 0.340 ms at 64 x 4k and 2.14 against 2.58 ms at 64 x 32k for 64-token tiles (hardware conversion),
# and faster with the integer conversion too; bf16 and mxfp4 were fastest at 64
FP8_BLOCK_N = 128


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
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]: query dtype, or uint8 fp8 / int8 codes;
    # mxfp4: [num_blocks, block_size, H_kv, D // 2] uint8, two 4-bit codes a byte
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,  # fp8: [num_blocks, block_size, H_kv] fp32; int8: see k_zero;
    # mxfp4: [num_blocks, block_size, H_kv, D // 32] uint8
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,  # given: int8 KIVI pool, fields as in check_int8_fields
    v_zero: torch.Tensor | None = None,
    k_open: torch.Tensor | None = None,  # int8: OpenKeyShadows.pool (may have 0 rows)
    k_open_slot: torch.Tensor | None = None,  # int8: OpenKeyShadows.slot_of_block
    block_n: int
    | None = None,  # KV tokens per tile, a power of two >= 16: 64 (int8: 32; fp8: 128; mxfp4: 64 only)
    target_programs: int = 264,
    num_warps: int | None = None,  # 4 (int8: 8)
    native_fp8_decode: bool | None = None,  # fp8: None = native_fp8(query.device)
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Launches the split pass and the merge pass on the current stream after checking arguments.

    Every sequence must have exactly one query row (pure decode); use paged_prefill otherwise.
    Dense caches need no scales; fp8_e4m3 caches k_scale / v_scale (fp32); mxfp4 caches k_scale /
    v_scale as uint8 exponents (their dtype selects the format); int8 KIVI caches (k_zero given) all six
    of k_scale, v_scale, k_zero, v_zero, k_open, k_open_slot.
    int8 defaults to 32-token tiles on 8 warps: the smallest-footprint configuration in which ptxas
    (sm_80, sm_90) reports no register spills for head_dim 64 and 128; 64 tokens on 4 warps spill.
    """
    int8 = k_zero is not None
    mxfp4 = k_scale is not None and k_scale.dtype == torch.uint8 and not int8
    fp8 = k_scale is not None and not int8 and not mxfp4
    shape = check_paged_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        kv_dtype=torch.uint8 if fp8 or int8 or mxfp4 else None,
        codes_per_byte=2 if mxfp4 else 1,
    )
    if query.shape[0] != shape.num_seqs:
        raise ValueError(
            f"paged_decode needs one query row per sequence: {query.shape[0]} rows, {shape.num_seqs} seqs"
        )
    v_group = 1
    if fp8:
        check_scales(k_scale, v_scale, k_cache)
    if mxfp4:
        check_scales(k_scale, v_scale, k_cache, dtype=torch.uint8, groups=shape.head_dim // 32)
        if block_n not in (None, MXFP4_BLOCK_N):
            raise ValueError(
                f"mxfp4 decode takes block_n {MXFP4_BLOCK_N} only (the tile height checked on a GPU), "
                f"got {block_n}"
            )
    if int8:
        v_group = check_int8_fields(query, k_cache, k_scale, v_scale, k_zero, v_zero, k_open, k_open_slot)
    if block_n is None:
        block_n = INT8_BLOCK_N if int8 else FP8_BLOCK_N if fp8 else 64
    if num_warps is None:
        num_warps = INT8_NUM_WARPS if int8 else 4
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
    # Pointers a variant does not read still need a tensor: o_part stands in.
    k_scale_arg = v_scale_arg = k_zero_arg = v_zero_arg = k_open_arg = k_open_slot_arg = o_part
    v_strides: tuple[int, ...] = (0, 0, 0)
    k_strides: tuple[int, ...] = (0, 0)
    k_open_strides: tuple[int, ...] = (0, 0, 0)
    if fp8:
        assert k_scale is not None and v_scale is not None
        k_scale_arg, v_scale_arg = k_scale, v_scale
        v_strides = (*k_scale.stride()[:2], 1)  # [num_blocks, block_size, H_kv], shared by K and V
    if mxfp4:
        assert k_scale is not None and v_scale is not None
        k_scale_arg, v_scale_arg = k_scale, v_scale
        v_strides = k_scale.stride()[:3]  # [num_blocks, block_size, H_kv, D // 32], shared by K and V
    if int8:
        assert k_scale is not None and v_scale is not None and k_zero is not None and v_zero is not None
        assert k_open is not None and k_open_slot is not None
        k_scale_arg, v_scale_arg, k_zero_arg, v_zero_arg = k_scale, v_scale, k_zero, v_zero
        # no open block: every slot is -1, the shadow pool is never read and may have 0 rows
        k_open_arg, k_open_slot_arg = (k_open if k_open.numel() else query), k_open_slot
        v_strides, k_strides, k_open_strides = v_scale.stride()[:3], k_scale.stride()[:2], k_open.stride()[:3]
    native = fp8 and (native_fp8(query.device) if native_fp8_decode is None else native_fp8_decode)
    paged_decode_split_kernel[(shape.num_seqs, shape.num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale_arg, v_scale_arg, k_zero_arg, v_zero_arg, k_open_arg, k_open_slot_arg,
        o_part, lse_part, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, tokens_per_split,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *v_strides, *k_strides, *k_open_strides, shape.num_heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=shape.head_dim,
        BLOCK_SIZE=shape.block_size, BLOCK_N=block_n, DOT_FP32=dot_fp32(query), FP8_KV=fp8, INT8_KV=int8,
        MXFP4_KV=mxfp4, NATIVE_FP8=native, V_GROUP=v_group, TILE_BLOCKS=max(1, block_n // shape.block_size), num_warps=num_warps,
    )  # fmt: skip
    merge_splits_kernel[(shape.num_seqs, shape.num_heads)](
        o_part, lse_part, out, query_start_loc, out.stride(0), out.stride(1), shape.num_heads, num_splits,
        HEAD_DIM=shape.head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
    )  # fmt: skip
    return out
