"""The KV codecs' codes decoded inside the Triton attention kernels (paged_decode.py, paged_prefill.py):
fp8 E4M3 (the hardware conversion where there is one, else an exact integer bit trick), MX FP4 (E2M1
codes, UE8M0 group exponents) and int8 KIVI tiles (K per channel over a block with open blocks read
from their full-precision shadows, V per token and group). Each returns what QuantizedLayerKV.gather
hands the reference, bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_to_fp16(codes):
    """fp8 e4m3fn bit patterns (uint8) -> exact fp16 with integer ops, on every arch (sm_80 has no
    fp8 type): sign to bit 15, exponent|mantissa to bits 7..13, then x 2^8 for the bias 7 -> 15.
    Subnormals land on fp16 subnormals and come out exact too; NaN codes (never written) do not."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def e4m3_native_to_fp16(codes):
    """The same with the hardware conversion (sm_89 and later: cvt from e4m3x2), exact as well."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def e4m3_to_fp32(codes):
    """fp8 e4m3fn bit patterns (uint8) -> exact fp32 with integer ops: sign to bit 31,
    exponent|mantissa to bits 20..26 (the value times 2^-120, subnormal codes on fp32 subnormals),
    then x 2^120. For bf16 queries this skips the fp16 -> bf16 conversion the fp16 routes need."""
    c = codes.to(tl.uint32)
    bits = ((c & 0x80) << 24) | ((c & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


def native_fp8(device: torch.device) -> bool:
    """Whether the kernels decode fp8 codes with the hardware conversion: CUDA devices of compute
    capability 8.9 or later (Ada, Hopper, Blackwell); elsewhere, and under the CPU interpreter, the
    integer bit trick."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


MXFP4_BLOCK_N = 64  # the only mxfp4 tile height checked on a GPU (mxfp4_tile's docstring)


@triton.jit
def e2m1_to_fp16(codes):
    """4-bit E2M1 codes (low nibble of uint8) -> exact fp16 with integer ops: sign to bit 15,
    exponent|mantissa to bits 9..11, then x 2^14 for the bias 1 -> 15. The subnormal code 1 (0.5)
    lands on the fp16 subnormal 2^-15, so it comes out exact too."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def e8m0_to_fp32(exponents):
    """UE8M0 scales (uint8 e) -> 2^(e - 127) in fp32 with integer ops: e is the fp32 exponent field,
    except e = 0, whose 2^-127 is the fp32 subnormal with mantissa bit 22 set. e = 255 (NaN in OCP MX)
    is never written (Mxfp4Codec clamps e to [0, 254])."""
    e = exponents.to(tl.uint32)
    bits = tl.where(e == 0, 0x400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(
    codes_ptr, scale_ptr, rows, scale_rows, n_ok, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """K or V tile [BLOCK_N, D] of an mxfp4 pool in OUT_DTYPE: each byte split into its two channels
    (low nibble first), E2M1 value * 2^(e - 127) of the channel's group of 32 in fp32, rounded once.
    Masked tokens load code 0 and read as 0. On an H200 (Triton 3.6) the decode kernel matched the
    reference with 64-token tiles (over 16- and 32-token blocks), but 16-token tiles over 32-token
    blocks gave wrong results there, though right in the interpreter; so the launcher takes
    MXFP4_BLOCK_N only."""
    GROUPS: tl.constexpr = HEAD_DIM // 32
    offs_b = tl.arange(0, HEAD_DIM // 2)
    packed = tl.load(codes_ptr + rows[:, None] + offs_b[None, :], mask=n_ok[:, None], other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, HEAD_DIM])  # channel 2b, 2b + 1
    groups = scale_rows[:, None] + tl.arange(0, GROUPS)[None, :]  # [BLOCK_N, GROUPS]
    scale = e8m0_to_fp32(tl.load(scale_ptr + groups, mask=n_ok[:, None], other=0))
    x = tl.reshape(e2m1_to_fp16(codes).to(tl.float32), [BLOCK_N, GROUPS, 32]) * scale[:, :, None]
    return tl.reshape(x, [BLOCK_N, HEAD_DIM]).to(OUT_DTYPE)


@triton.jit
def int8_kivi_k(
    codes_ptr, scale_ptr, zero_ptr, open_ptr, open_slot_ptr, table, start_n, split_end, block_ids, in_block,
    kv_head, rows, n_ok, offs_d, stride_ksb, stride_ksh, stride_ob, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """K tile [BLOCK_N, D] of an int8 KIVI pool in open_ptr's dtype (the compute dtype).

    Closed blocks: code * scale + zero in fp32, rounded once (as QuantizedLayerKV.gather does); scale
    and zero are per (block, channel), loaded once per block of the tile (TILE_BLOCKS of them; the
    tile starts on a block boundary or lies inside one block) and broadcast over its tokens.
    Open blocks: the full-precision shadow open[slot_of_block[block]]."""
    TOKENS: tl.constexpr = BLOCK_N // TILE_BLOCKS  # tokens of the tile in each of its blocks
    slot = tl.load(open_slot_ptr + block_ids, mask=n_ok, other=-1)  # per token
    is_open = slot >= 0
    codes = tl.load(codes_ptr + rows[:, None] + offs_d[None, :], mask=(n_ok & ~is_open)[:, None], other=0)
    firsts = start_n + tl.arange(0, TILE_BLOCKS) * TOKENS  # first token of each block in the tile
    b_ok = firsts < split_end
    tile_blocks = tl.load(table + firsts // BLOCK_SIZE, mask=b_ok, other=0).to(tl.int64)
    affine = (tile_blocks * stride_ksb + kv_head * stride_ksh)[:, None] + offs_d[None, :]  # [TILE_BLOCKS, D]
    scale = tl.load(scale_ptr + affine, mask=b_ok[:, None], other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + affine, mask=b_ok[:, None], other=0.0).to(tl.float32)
    codes = tl.reshape(codes, [TILE_BLOCKS, TOKENS, HEAD_DIM]).to(tl.float32)
    k = codes * scale[:, None, :] + zero[:, None, :]
    k = tl.reshape(k, [BLOCK_N, HEAD_DIM]).to(open_ptr.dtype.element_ty)
    open_rows = slot.to(tl.int64) * stride_ob + in_block * stride_ot + kv_head * stride_oh
    shadow = tl.load(
        open_ptr + open_rows[:, None] + offs_d[None, :], mask=(n_ok & is_open)[:, None], other=0.0
    )
    return tl.where(is_open[:, None], shadow, k)


@triton.jit
def int8_kivi_v(
    codes_ptr, scale_ptr, zero_ptr, rows, scale_rows, n_ok, offs_d, OUT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, V_GROUP: tl.constexpr,
):  # fmt: skip
    """V tile [BLOCK_N, D] of an int8 KIVI pool in OUT_DTYPE: code * scale + zero in fp32, rounded
    once; scale and zero per (token, group of V_GROUP channels), loaded once per group."""
    GROUPS: tl.constexpr = HEAD_DIM // V_GROUP
    codes = tl.load(codes_ptr + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
    affine = scale_rows[:, None] + tl.arange(0, GROUPS)[None, :]  # [BLOCK_N, GROUPS]
    scale = tl.load(scale_ptr + affine, mask=n_ok[:, None], other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + affine, mask=n_ok[:, None], other=0.0).to(tl.float32)
    codes = tl.reshape(codes, [BLOCK_N, GROUPS, V_GROUP]).to(tl.float32)
    v = codes * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(v, [BLOCK_N, HEAD_DIM]).to(OUT_DTYPE)
