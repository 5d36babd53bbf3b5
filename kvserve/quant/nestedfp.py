"""NestedFP weights: one FP16 copy split into two byte planes, whose upper plane is an FP8 E4M3 view.

For an FP16 weight w with |w| < 1.875 (exponent field below 16) the 15 magnitude bits are
`A << 8 | lo`, A being 6 bits. The planes are

- `hi` = sign | round(magnitude >> 7): the low 4 exponent bits and the top 3 mantissa bits, rounded
  to nearest even on the 7 bits below. Read as E4M3 it is the E4M3 rounding of w * 2^8 (bit for bit
  `(w * 256).to(torch.float8_e4m3fn)` for |w| <= 1.75); it never rounds up past 0x7E (448), so
  values in (1.75, 1.875) saturate to 1.75 there;
- `lo` = the low 8 mantissa bits.

The merge is lossless: rounding added 0 or 1 to `2A + (lo >> 7)`, so A = ((hi & 0x7F) - (lo >> 7))
>> 1 and the FP16 bits are sign | A << 8 | lo. FP16 mode reads both planes (2 bytes a weight), FP8
mode only `hi` (1 byte).

Beyond the seed (background.md section 4), which leaves every tensor with some |w| > 1.75 in plain
FP16 (152 of SmolLM2's 210 linear weights): each output channel gets a power-of-two pre-scale 2^e
that brings its largest |w| into (0.875, 1.75], taken before the FP16 conversion and undone in the
kernel's epilogue (y[:, c] *= 2^-e). A power of two only moves the exponent, so the FP16 planes
stay an exact split of the scaled FP16 weights, and a channel of small weights also gains FP8
precision (its values move away from E4M3's subnormals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_LIMIT = 1.75  # E4M3's largest finite value (448) / 2^8
SPLIT_LIMIT = 1.875  # exclusive: the FP16 exponent field must stay below 16
HI_MAX = 0x7E  # E4M3 448; 0x7F is NaN


def split(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP16 weights (finite, |w| < 1.875) -> (hi, lo) uint8 planes."""
    assert w.dtype == torch.float16, w.dtype
    if not bool(torch.isfinite(w).all()) or bool((w.abs() >= SPLIT_LIMIT).any()):
        raise ValueError("NestedFP needs finite FP16 weights with |w| < 1.875 (pre-scale them)")
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    sign = (bits >> 8) & 0x80
    mag = bits & 0x7FFF
    top, rest = mag >> 7, mag & 0x7F
    up = (rest > 64) | ((rest == 64) & ((top & 1) == 1))
    up &= top < HI_MAX  # saturate: never round into 0x7F (NaN)
    hi = sign | (top + up.to(torch.int32))
    lo = bits & 0xFF
    return hi.to(torch.uint8), lo.to(torch.uint8)


def merge(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The FP16 weights back from their planes, bit for bit."""
    h, low = hi.to(torch.int32), lo.to(torch.int32)
    a = ((h & 0x7F) - (low >> 7)) >> 1
    bits = ((h & 0x80) << 8) | (a << 8) | low
    return bits.to(torch.int16).view(torch.float16)  # int32 -> int16 keeps the low 16 bits


def fp8_view(hi: torch.Tensor) -> torch.Tensor:
    """The `hi` plane as E4M3 values of w * 2^8."""
    return hi.view(torch.float8_e4m3fn)


def channel_exponents(w: torch.Tensor, limit: float = FP8_LIMIT) -> torch.Tensor:
    """Per output channel (row) the e with max|w| * 2^e in (limit / 2, limit]; 0 for an all-zero
    row. int8 (the shifts SmolLM2 needs are a few steps either way; clamped to [-64, 63])."""
    amax = w.float().abs().amax(dim=1)
    safe = torch.where(amax > 0, amax, torch.full_like(amax, limit))
    e = torch.floor(torch.log2(limit / safe))
    # log2 rounding: step down where the scaled max would pass the limit, up where it is too small
    e = torch.where(safe * torch.exp2(e) > limit, e - 1, e)
    e = torch.where(safe * torch.exp2(e + 1) <= limit, e + 1, e)
    return e.clamp(-64, 63).to(torch.int8)


@dataclass
class NestedWeight:
    """A linear weight [out, in] as NestedFP planes plus one power-of-two exponent per output row."""

    hi: torch.Tensor  # uint8 [out, in]
    lo: torch.Tensor  # uint8 [out, in]
    exponent: torch.Tensor  # int8 [out]: the planes hold w * 2^exponent

    @classmethod
    def from_float(cls, w: torch.Tensor) -> NestedWeight:
        w32 = w.float()
        if not bool(torch.isfinite(w32).all()):
            raise ValueError("NestedFP needs finite weights")
        e = channel_exponents(w32)
        w16 = (w32 * torch.exp2(e.float()).unsqueeze(1)).to(torch.float16)
        hi, lo = split(w16)
        return cls(hi, lo, e)

    @property
    def shape(self) -> torch.Size:
        return self.hi.shape

    @property
    def nbytes(self) -> int:
        return self.hi.numel() + self.lo.numel() + self.exponent.numel()

    @property
    def scale(self) -> torch.Tensor:
        """fp32 [out]: what the kernel's epilogue multiplies each output channel by (2^-exponent)."""
        return torch.exp2(-self.exponent.float())

    def fp16(self) -> torch.Tensor:
        """The scaled FP16 weights (FP16 mode reads these), exactly as converted."""
        return merge(self.hi, self.lo)

    def dequant(self, mode: str) -> torch.Tensor:
        """The weight each mode computes with, in fp32: FP16 mode the merged planes, FP8 mode the
        E4M3 view / 2^8, both times the channel scale (the slow reference of the kernels)."""
        if mode == "fp16":
            w = self.fp16().float()
        elif mode == "fp8":
            w = fp8_view(self.hi).float() / 256.0
        else:
            raise ValueError(f"mode must be fp16 or fp8 (got {mode!r})")
        return w * self.scale.unsqueeze(1)


@dataclass(frozen=True)
class LayerReport:
    """One linear weight: range, pre-scales, and the error of each step against the source."""

    name: str
    shape: tuple[int, int]
    max_abs: float
    in_range: bool  # max|w| <= 1.75: the seed could nest it without a pre-scale
    exponent_min: int
    exponent_max: int
    fp16_max_abs_error: float  # conversion (scaled, rounded to FP16, unscaled) vs the source
    fp16_mean_abs_error: float
    fp16_overflow: int  # weights that would be +-inf in plain FP16 (no pre-scale)
    fp8_rel_error: float  # ||W_fp8 - W|| / ||W|| (Frobenius)
    fp8_max_abs_error: float


def report(name: str, w: torch.Tensor) -> LayerReport:
    w32 = w.float()
    nested = NestedWeight.from_float(w32)
    fp16_err = (nested.dequant("fp16") - w32).abs()
    fp8_err = nested.dequant("fp8") - w32
    norm = float(w32.norm()) or 1.0
    return LayerReport(
        name=name,
        shape=(int(w.shape[0]), int(w.shape[1])),
        max_abs=float(w32.abs().max()),
        in_range=bool(w32.abs().max() <= FP8_LIMIT),
        exponent_min=int(nested.exponent.min()),
        exponent_max=int(nested.exponent.max()),
        fp16_max_abs_error=float(fp16_err.max()),
        fp16_mean_abs_error=float(fp16_err.mean()),
        fp16_overflow=int(torch.isinf(w32.to(torch.float16)).sum()),
        fp8_rel_error=float(fp8_err.norm()) / norm,
        fp8_max_abs_error=float(fp8_err.abs().max()),
    )
