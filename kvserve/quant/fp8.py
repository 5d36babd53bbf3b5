"""FP8 E4M3 KV with one fp32 scale per (token, kv-head): scale = amax / 448."""

from __future__ import annotations

import torch

from kvserve.quant.base import FieldSpecs, Packed, PerTokenCodec, divide, safe_scale

E4M3_MAX = 448.0


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, saturating: clamp to +-448 first, since torch <= 2.11 (and some
    kernels) turn out-of-range values into NaN while newer CPU torch saturates. NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def finite_amax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """amax of |x| over `dims` ignoring NaN and inf, so one bad value does not poison its group."""
    x = x.float().abs()
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x)).amax(dims)


class Fp8Codec(PerTokenCodec):
    def token_specs(self) -> FieldSpecs:
        h, d = self.num_kv_heads, self.head_dim
        return {"codes": ((h, d), torch.uint8), "scale": ((h,), torch.float32)}

    def encode(self, x: torch.Tensor) -> Packed:
        scale = divide(finite_amax(x, (-1,)), E4M3_MAX)  # [..., H] fp32
        codes = cast_e4m3(x.float() / safe_scale(scale).unsqueeze(-1))  # [..., H, D] e4m3
        return {"codes": codes.view(torch.uint8), "scale": scale}

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = packed["codes"].view(torch.float8_e4m3fn).float()
        return codes * packed["scale"].unsqueeze(-1)
