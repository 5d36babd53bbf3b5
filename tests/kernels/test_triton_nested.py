"""The Triton NestedFP linear (kvserve/kernels/triton/nested_linear.py) against the fp32 reference of
each mode, under the CPU interpreter (or on a GPU), with shapes that leave partial tiles."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvserve.kernels.triton.nested_linear import nested_linear  # noqa: E402
from kvserve.quant.nestedfp import NestedWeight  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if ON_GPU else "cpu"


def planes(out_f: int, in_f: int, seed: int) -> NestedWeight:
    gen = torch.Generator().manual_seed(seed)
    return NestedWeight.from_float(
        torch.randn(out_f, in_f, generator=gen) * torch.logspace(-2, 1, out_f)[:, None]
    )


LAUNCHES = {  # the default; the weight as the dot's first operand; inputs split three ways, with and without
    "default": {},
    "swap": dict(swap=True, block_m=16, block_n=64),
    "split": dict(split_k=3, block_k=32),
    "swap-split": dict(swap=True, split_k=2, block_m=16, block_n=64, block_k=32),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("mode", ["fp8", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_matches_the_modes_reference(mode, dtype, rows, launch):
    n = planes(48, 96, rows)  # 48 outputs and 96 inputs: partial 64-wide tiles both ways (and 32-wide splits)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    on = {k: v.to(DEVICE) for k, v in (("hi", n.hi), ("lo", n.lo), ("scale", n.scale))}
    y = nested_linear(
        x.to(DEVICE), on["hi"], on["lo"], on["scale"], fp16=mode == "fp16", **LAUNCHES[launch]
    ).cpu()
    assert y.dtype == dtype and y.shape == (rows, 48)
    want = x.float() @ n.dequant(mode).T
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), want, atol=tol * float(want.abs().max()), rtol=0)


def test_fp8_mode_reads_only_the_upper_plane():
    n = planes(32, 64, 3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8))
    garbage = torch.randint(0, 256, n.lo.shape, dtype=torch.uint8)
    args = (n.hi.to(DEVICE), n.scale.to(DEVICE))
    a = nested_linear(x.to(DEVICE), args[0], n.lo.to(DEVICE), args[1], fp16=False)
    b = nested_linear(x.to(DEVICE), args[0], garbage.to(DEVICE), args[1], fp16=False)
    assert torch.equal(a, b)


def test_rejects_mismatched_shapes():
    n = planes(16, 32, 4)
    with pytest.raises(ValueError, match="planes"):
        nested_linear(torch.randn(2, 31), n.hi, n.lo, n.scale, fp16=True)
    with pytest.raises(ValueError, match="uint8"):
        nested_linear(torch.randn(2, 32), n.hi.float(), n.lo, n.scale, fp16=True)
    with pytest.raises(ValueError, match="split_k"):
        nested_linear(torch.randn(2, 32), n.hi, n.lo, n.scale, fp16=True, split_k=0)
