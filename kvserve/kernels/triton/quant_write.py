"""Fused quantize-and-scatter of new K/V tokens into a quantized paged pool (fp8_e4m3, int8 V).

One program per (token, kv-head): load the head_dim vector, compute its scale, quantize, write the
codes and scale to the token's pool slot; slot -1 is skipped. Results equal the torch reference
codecs in kvserve/quant/ bit for bit: divisions are IEEE (div_rn), rounding is half to even, and
the fp8 code is assembled with integer arithmetic instead of a float -> fp8 cast (the cast is wrong
under TRITON_INTERPRET=1, and integer assembly is exact everywhere).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


# Reductions go through tl.reduce with local combine functions rather than tl.max / tl.min: those
# are @jit functions of triton's standard library, bound at `import triton`, so they break under
# TRITON_INTERPRET=1 when triton was imported before the variable was set (as in a test session).
@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _rint(v):
    """Round half to even, exact for |v| < 2**22."""
    r = tl.floor(v + 0.5)
    tie_to_odd = (r - v == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _e4m3_bits(y):
    """fp32 y with |y| <= 448 (or NaN) -> e4m3fn bit pattern as int32, rounding half to even."""
    mag = tl.abs(y)
    exp = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |y|) for normals
    exp = tl.maximum(exp, -6)  # below 2**-6 the grid is the subnormal one, step 2**-9
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exp - 3), 3 mantissa bits
    q = _rint(mag / ulp) * ulp  # exact: dividing by a power of two
    q = tl.where(q == q, q, 0.0)  # NaN lanes get their code below
    q_exp = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    is_normal = q >= 0.015625  # 2**-6
    mant_normal = ((q.to(tl.int32, bitcast=True) >> 20) & 7) | ((q_exp + 7) << 3)
    mant_sub = (q * 512.0).to(tl.int32)  # q / 2**-9 in 0..7
    bits = tl.where(is_normal, mant_normal, mant_sub)
    bits = tl.where(y.to(tl.int32, bitcast=True) < 0, bits | 0x80, bits)  # sign bit, -0.0 too
    return tl.where(y != y, 0x7F, bits)


@triton.jit
def _fp8_write_kernel(
    x_ptr, slot_ptr, codes_ptr, scale_ptr,
    stride_xt, stride_xh, num_kv_heads,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, HEAD_DIM)
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs).to(tl.float32)
        finite = tl.abs(x) <= 3.4028234663852886e38  # false for NaN and inf
        amax = tl.reduce(tl.where(finite, tl.abs(x), 0.0), 0, _max2)
        scale = tl.math.div_rn(amax, 448.0)  # E4M3 max
        safe = tl.where(scale > 0, scale, 1.0)
        y = tl.math.div_rn(x, safe)
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # NaN passes
        row = slot * num_kv_heads + h
        tl.store(codes_ptr + row * HEAD_DIM + offs, _e4m3_bits(y).to(tl.uint8))
        tl.store(scale_ptr + row, scale)


@triton.jit
def _int8_asym_write_kernel(
    x_ptr, slot_ptr, codes_ptr, scale_ptr, zero_ptr,
    stride_xt, stride_xh, num_kv_heads,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        num_groups: tl.constexpr = HEAD_DIM // GROUP
        offs = tl.arange(0, num_groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, gs]
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs).to(tl.float32)
        lo = tl.reduce(x, 1, _min2)
        hi = tl.reduce(x, 1, _max2)
        zero = lo.to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(hi - zero, 255.0).to(tl.float16).to(tl.float32)
        safe = tl.where(scale > 0, scale, 1.0)
        codes = _rint(tl.math.div_rn(x - zero[:, None], safe[:, None]))
        codes = tl.minimum(tl.maximum(codes, 0.0), 255.0)
        row = slot * num_kv_heads + h
        tl.store(codes_ptr + row * HEAD_DIM + offs, codes.to(tl.uint8))
        g = tl.arange(0, num_groups)
        tl.store(scale_ptr + row * num_groups + g, scale.to(tl.float16))
        tl.store(zero_ptr + row * num_groups + g, zero.to(tl.float16))


def _check(x: torch.Tensor, slot_mapping: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [num_tokens, num_kv_heads, head_dim] with unit last stride, got {tuple(x.shape)}"
        )
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype must be fp16, bf16 or fp32, got {x.dtype}")
    if slot_mapping.shape != (x.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be [{x.shape[0]}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    head_dim = x.shape[2]
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    for name, field in fields.items():
        if not field.is_contiguous() or field.device != x.device:
            raise ValueError(f"pool field {name} must be contiguous and on {x.device}")
    if slot_mapping.device != x.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, x on {x.device}")


def fp8_quant_write(
    x: torch.Tensor, slot_mapping: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
) -> None:
    """x [T, H, D] -> codes [num_blocks, block_size, H, D] uint8 (e4m3 bits), scale [.., H] fp32."""
    _check(x, slot_mapping, {"codes": codes, "scale": scale})
    t, h, d = x.shape
    if codes.dtype != torch.uint8 or codes.shape[2:] != (h, d) or scale.dtype != torch.float32:
        raise ValueError(f"fp8 pool must be codes [.., {h}, {d}] uint8 and scale [.., {h}] fp32")
    if t:
        _fp8_write_kernel[(t, h)](x, slot_mapping, codes, scale, x.stride(0), x.stride(1), h, HEAD_DIM=d)


def int8_value_quant_write(
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> None:
    """KIVI int8 V: x [T, H, D] -> codes [.., H, D] uint8, scale/zero [.., H, D / group_size] fp16."""
    _check(x, slot_mapping, {"codes": codes, "scale": scale, "zero": zero})
    t, h, d = x.shape
    if codes.dtype != torch.uint8 or codes.shape[2:] != (h, d) or scale.shape[2:] != (h, d // group_size):
        raise ValueError(
            f"int8 V pool must be codes [.., {h}, {d}] uint8, scale/zero [.., {h}, {d // group_size}]"
        )
    if scale.dtype != torch.float16 or zero.dtype != torch.float16 or d % group_size:
        raise ValueError(f"scale and zero must be fp16 and group_size must divide {d}")
    if t:
        _int8_asym_write_kernel[(t, h)](
            x, slot_mapping, codes, scale, zero, x.stride(0), x.stride(1), h, HEAD_DIM=d, GROUP=group_size
        )


def fused_writer(codec) -> Callable | None:
    """The kernel here that writes `codec`'s fields (kvserve/quant/) bit for bit as its encode and an
    index_copy_ would, as fn(fields, slots [T] int64, x [T, H, D]) with slot -1 skipped on the device;
    None for other codecs (fp8_e4m3 K and V and int8 KIVI V have one). QuantizedLayerKV.attach_fused_writes
    takes it."""
    from kvserve.quant.fp8 import Fp8Codec
    from kvserve.quant.kivi import KiviValueCodec

    if isinstance(codec, Fp8Codec):
        return lambda fields, slots, x: fp8_quant_write(x, slots, fields["codes"], fields["scale"])
    if isinstance(codec, KiviValueCodec) and codec.bits == 8:
        return lambda fields, slots, x: int8_value_quant_write(
            x, slots, fields["codes"], fields["scale"], fields["zero"], codec.group_size
        )
    return None
