"""FP4 (E2M1) KV: NVFP4 and the OCP MXFP4 standard.

E2M1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; a 4-bit code is sign << 3 | magnitude index, two
codes per byte. NVFP4: an E4M3 scale per 16 values = block_amax / (6 * global) and an fp32 global
scale = amax / (6 * 448) per token (over all kv-heads); x = code * e4m3(scale) * global.
MXFP4: a UE8M0 (power of two) scale per 32 values with exponent floor(log2 amax) - 2; values
beyond 6 * scale saturate.
"""

from __future__ import annotations

import torch

from kvserve.quant.base import FieldSpecs, Packed, PerTokenCodec, safe_scale
from kvserve.quant.bitpack import pack_bits, unpack_bits
from kvserve.quant.fp8 import E4M3_MAX, cast_e4m3, finite_amax

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
UE8M0_BIAS = 127


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (saturating at +-6) -> 4-bit codes uint8."""
    grid = torch.tensor(E2M1_VALUES, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2
    index = torch.bucketize(y.abs().clamp(max=E2M1_MAX).contiguous(), mids)  # [...] in 0..7
    return (((y < 0).to(torch.int64) << 3) | index).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES, device=codes.device)
    magnitude = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -magnitude, magnitude)


class Nvfp4Codec(PerTokenCodec):
    block = 16

    def token_specs(self) -> FieldSpecs:
        h, d = self.num_kv_heads, self.head_dim
        return {
            "codes": ((h, d // 2), torch.uint8),
            "scale": ((h, d // self.block), torch.uint8),  # E4M3 bits
            "global": ((), torch.float32),
        }

    def encode(self, x: torch.Tensor) -> Packed:
        x = x.float()
        blocks = x.reshape(*x.shape[:-1], -1, self.block)  # [..., H, D/16, 16]
        global_scale = finite_amax(x, (-2, -1)) / (E2M1_MAX * E4M3_MAX)  # [...]
        g = safe_scale(global_scale)[..., None, None]
        scale = cast_e4m3(finite_amax(blocks, (-1,)) / (E2M1_MAX * g))  # [..., H, D/16] e4m3
        step = safe_scale(scale.float() * g).unsqueeze(-1)
        codes = encode_e2m1(blocks / step).reshape(x.shape)
        return {"codes": pack_bits(codes, 4), "scale": scale.view(torch.uint8), "global": global_scale}

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed["codes"], 4)  # [..., H, D]
        blocks = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, self.block)
        scale = packed["scale"].view(torch.float8_e4m3fn).float() * packed["global"][..., None, None]
        return (blocks * scale.unsqueeze(-1)).reshape(codes.shape)


class Mxfp4Codec(PerTokenCodec):
    block = 32

    def token_specs(self) -> FieldSpecs:
        h, d = self.num_kv_heads, self.head_dim
        return {"codes": ((h, d // 2), torch.uint8), "scale": ((h, d // self.block), torch.uint8)}

    def encode(self, x: torch.Tensor) -> Packed:
        x = x.float()
        blocks = x.reshape(*x.shape[:-1], -1, self.block)  # [..., H, D/32, 32]
        amax = finite_amax(blocks, (-1,))
        # OCP rule: shared exponent floor(log2 amax) - emax(E2M1) = floor(log2 amax) - 2.
        exponent = torch.floor(torch.log2(safe_scale(amax))) - 2
        exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -UE8M0_BIAS))
        exponent = exponent.clamp(-UE8M0_BIAS, UE8M0_BIAS)
        codes = encode_e2m1(blocks / torch.exp2(exponent).unsqueeze(-1)).reshape(x.shape)
        return {"codes": pack_bits(codes, 4), "scale": (exponent + UE8M0_BIAS).to(torch.uint8)}

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed["codes"], 4)
        blocks = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, self.block)
        scale = torch.exp2(packed["scale"].float() - UE8M0_BIAS)
        return (blocks * scale.unsqueeze(-1)).reshape(codes.shape)
