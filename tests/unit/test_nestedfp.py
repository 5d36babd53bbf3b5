"""NestedFP planes (kvserve/quant/nestedfp.py): lossless over every FP16 pattern in range, the upper
plane is torch's E4M3 rounding of w * 2^8, saturation, the per-channel power-of-two pre-scale, and
the fp32 references of both modes."""

from __future__ import annotations

import pytest
import torch

from kvserve.quant.nestedfp import (
    FP8_LIMIT,
    HI_MAX,
    NestedWeight,
    channel_exponents,
    fp8_view,
    merge,
    report,
    split,
)

ALL_FP16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


def in_split_range(v: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(v) & (v.abs() < 1.875)


def test_merge_of_split_is_bit_exact_for_every_fp16_pattern_in_range() -> None:
    v = ALL_FP16[in_split_range(ALL_FP16)]
    assert v.numel() == 2 * (0x3C00 + 0x380)  # exponent field < 15, or 15 with mantissa < 0x380
    hi, lo = split(v)
    assert torch.equal(merge(hi, lo).view(torch.int16), v.view(torch.int16))


def test_the_upper_plane_is_torchs_e4m3_rounding_of_w_times_256() -> None:
    v = ALL_FP16[torch.isfinite(ALL_FP16) & (ALL_FP16.abs() <= FP8_LIMIT)]
    hi, _ = split(v)
    want = (v.float() * 256).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(hi, want)


def test_values_between_1_75_and_1_875_saturate_and_larger_ones_are_refused() -> None:
    v = ALL_FP16[torch.isfinite(ALL_FP16) & (ALL_FP16.abs() > FP8_LIMIT) & (ALL_FP16.abs() < 1.875)]
    hi, lo = split(v)
    assert torch.equal(hi & 0x7F, torch.full_like(hi, HI_MAX))
    assert torch.equal(merge(hi, lo).view(torch.int16), v.view(torch.int16))
    assert bool((fp8_view(hi).float().abs() == 448).all())
    for bad in (1.875, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            split(torch.tensor([bad], dtype=torch.float16))


def test_channel_exponents_bring_each_row_into_the_upper_half_of_the_range() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g) * torch.logspace(-6, 3, 64).unsqueeze(1)
    w[7] = 0.0
    w[8, 0] = FP8_LIMIT  # exactly the limit: no shift
    e = channel_exponents(w)
    scaled_max = (w.abs() * torch.exp2(e.float()).unsqueeze(1)).amax(1)
    nonzero = w.abs().amax(1) > 0
    assert bool((scaled_max[nonzero] <= FP8_LIMIT).all())
    assert bool((scaled_max[nonzero] > FP8_LIMIT / 2).all())
    assert e[7] == 0 and e[8] == 0


def test_nested_weight_modes_against_their_definitions() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 40, generator=g) * torch.linspace(0.01, 9.0, 48).unsqueeze(1)
    nested = NestedWeight.from_float(w)
    assert nested.nbytes == 2 * w.numel() + w.shape[0]
    scaled16 = (w * torch.exp2(nested.exponent.float()).unsqueeze(1)).to(torch.float16)
    assert torch.equal(nested.fp16().view(torch.int16), scaled16.view(torch.int16))  # lossless
    fp16 = nested.dequant("fp16")
    assert torch.equal(fp16, scaled16.float() * nested.scale.unsqueeze(1))
    assert float((fp16 - w).abs().max()) <= float(w.abs().max()) * 2**-11
    fp8 = nested.dequant("fp8")
    want8 = (scaled16.float() * 256).to(torch.float8_e4m3fn).float() / 256 * nested.scale.unsqueeze(1)
    assert torch.equal(fp8, want8)
    assert float((fp8 - w).norm() / w.norm()) < 0.05
    with pytest.raises(ValueError):
        nested.dequant("int4")


def test_report_names_range_scales_and_errors() -> None:
    w = torch.tensor([[0.5, -0.25], [3.0, 1e-3], [70000.0, 1.0]])
    r = report("proj", w)
    assert r.shape == (3, 2) and not r.in_range and r.max_abs == 70000.0
    assert r.fp16_overflow == 1  # 70000 is inf in plain FP16; the pre-scale avoids it
    assert (r.exponent_min, r.exponent_max) == (-16, 1)  # 70000 * 2^-16, 0.5 * 2^1
    assert r.fp16_max_abs_error <= 70000.0 * 2**-11 and r.fp8_rel_error < 2**-4
