"""The CPU extension's nested_linear over NestedFP planes (csrc/cpu/nested_linear.cpp): FP16 mode is
bitwise the row_linear chain over the dequantized weights; FP8 mode takes x rounded to bf16 and is that
chain where it runs as FMAs, and close to it where vdpbf16ps adds pairs; both modes row invariant, close
to torch's linear over the reference, with clear refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.cpu_ext import cpu_capability
from kvserve.quant.nestedfp import NestedWeight, fp8_view, merge, split

MODES = ("fp8", "fp16")


def weight(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, NestedWeight]:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: every row gets its own power-of-two pre-scale
    w = torch.randn(out_f, in_f, generator=gen) * torch.logspace(-3, 1, out_f).unsqueeze(1)
    return w, NestedWeight.from_float(w)


def pairs_path(in_features: int) -> bool:
    """FP8 mode runs as bf16 pairs on vdpbf16ps (an even in_features on an AVX-512 BF16 build)."""
    return in_features % 2 == 0 and "_BF16" in cpu_capability()


def nested(ext, x, n: NestedWeight, mode: str, b=None):
    return ext.nested_linear(x, ext.pack_nested_weight(n.hi, n.lo), n.scale, b, n.shape[0], mode == "fp16")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 70])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (100, 37), (7, 3)])
def test_is_row_linear_over_the_dequantized_weight(ext, mode, rows, shape):
    out_f, in_f = shape
    w, n = weight(out_f, in_f, rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x, b = torch.randn(rows, in_f, generator=gen), torch.randn(out_f, generator=gen)
    ref = n.dequant(mode)
    y = nested(ext, x, n, mode, b)
    if mode == "fp8":  # FP8 mode multiplies x rounded to bf16
        x = x.bfloat16().float()
    if mode == "fp16" or not pairs_path(in_f):
        assert torch.equal(y, ext.row_linear(x, ext.pack_linear_weight(ref), b, out_f))
    # vdpbf16ps adds a pair of products its own way: close to the chain, not bitwise
    torch.testing.assert_close(y, F.linear(x, ref, b), atol=1e-3, rtol=1e-5)  # rows up to 10x: sums to ~300


def test_fp8_mode_takes_x_rounded_to_bf16(ext):
    _, n = weight(64, 576, 7)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(8))
    rounded = x.bfloat16().float()
    assert not torch.equal(x, rounded)
    assert torch.equal(nested(ext, x, n, "fp8"), nested(ext, rounded, n, "fp8"))
    assert not torch.equal(nested(ext, x, n, "fp16"), nested(ext, rounded, n, "fp16"))


def test_fp8_mode_error_is_the_formats_and_fp16_mode_is_nearly_exact(ext):
    w, n = weight(576, 576, 0)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(1))
    exact = F.linear(x, w)
    rel = {m: float((nested(ext, x, n, m) - exact).norm() / exact.norm()) for m in MODES}
    assert rel["fp16"] < 1e-3 and 1e-3 < rel["fp8"] < 0.05, rel


def test_a_row_does_not_depend_on_the_rows_beside_it(ext):
    w, n = weight(300, 576, 2)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(3))
    for mode in MODES:
        whole = nested(ext, x, n, mode)
        for r in (0, 7, 32):
            assert torch.equal(whole[r], nested(ext, x[r : r + 1].contiguous(), n, mode)[0])


def test_rejects_bad_arguments(ext):
    _, n = weight(8, 16, 4)
    packed = ext.pack_nested_weight(n.hi, n.lo)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.nested_linear(torch.randn(2, 16).double(), packed, n.scale, None, 8, True)
    with pytest.raises(RuntimeError, match="in_features"):
        ext.nested_linear(torch.randn(2, 15), packed, n.scale, None, 8, True)
    with pytest.raises(RuntimeError, match="scale"):
        ext.nested_linear(torch.randn(2, 16), packed, n.scale[:7], None, 8, False)
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.nested_linear(torch.randn(2, 16), packed, n.scale, None, 40, False)
    with pytest.raises(RuntimeError, match="uint8"):
        ext.pack_nested_weight(n.hi.float(), n.lo)


@pytest.mark.parametrize("mode", MODES)
def test_unpacked_weight_is_row_linears_packing_of_the_reference(ext, mode):
    w, n = weight(100, 37, 5)
    packed = ext.pack_nested_weight(n.hi, n.lo)
    unpacked = ext.unpack_nested_weight(packed, n.scale, 100, mode == "fp16")
    assert torch.equal(unpacked, ext.pack_linear_weight(n.dequant(mode)))
    x = torch.randn(130, 37, generator=torch.Generator().manual_seed(6))  # odd in_features: the FMA chain
    xm = x if mode == "fp16" else x.bfloat16().float()
    assert torch.equal(ext.row_linear(xm, unpacked, None, 100), nested(ext, x, n, mode))


def test_the_kernels_planes_rebuild_every_fp16_pattern_in_range(ext):
    """Plane 1 holds the residual below the FP8 view, not lo itself: the kernel's FP16 conversion of
    every FP16 weight with |w| < 1.875 (and the FP8 one of its hi byte) is exact."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    v = bits.view(torch.float16)
    v = v[torch.isfinite(v) & (v.abs() < 1.875)]
    v = v[: v.numel() // 16 * 16].reshape(-1, 16)  # [out, in]: every row a whole panel
    hi, lo = split(v)
    packed = ext.pack_nested_weight(hi, lo)
    ones = torch.ones(v.shape[0])
    fp16 = ext.unpack_nested_weight(packed, ones, v.shape[0], True)
    assert torch.equal(fp16, ext.pack_linear_weight(merge(hi, lo).float()))
    fp8 = ext.unpack_nested_weight(packed, ones, v.shape[0], False)
    assert torch.equal(fp8, ext.pack_linear_weight(fp8_view(hi).float() / 256))
    # FP8 mode's own conversion (bf16 pairs where the build has them; every hi byte, subnormals and signs
    # included): one-hot rows of x read each weight back exactly
    y = ext.nested_linear(torch.eye(16), packed, ones, None, v.shape[0], False)
    assert torch.equal(y, (fp8_view(hi).float() / 256).T)
