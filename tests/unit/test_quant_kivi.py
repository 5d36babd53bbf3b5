import pytest
import torch

from kvserve.quant.registry import make_codec


def outlier_k(n=4, bs=16, h=2, d=64):
    x = torch.randn(n, bs, h, d)
    x[..., ::16] *= 10  # per-channel outliers, as in real K
    return x


@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4), ("int3", 3), ("int2", 2)])
def test_k_per_channel_error_bound(name, bits):
    codec = make_codec(name, 2, 64)
    x = outlier_k()
    packed = codec.k.encode(x)
    assert packed["scale"].shape == (4, 2, 64) and packed["scale"].dtype == torch.float16
    assert packed["codes"].shape == (4, 16, 2, 64 * bits // 8)
    x_hat = codec.k.decode(packed)
    span = x.amax(1) - x.amin(1)  # [n, H, D]: one group per (block, head, channel)
    bound = span / ((1 << bits) - 1) / 2 * 1.01 + 2e-3 * x.abs().amax(1)  # half a step + fp16 slack
    assert ((x_hat - x).abs() <= bound.unsqueeze(1)).all()


@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4), ("int2", 2)])
def test_v_per_token_group_error_bound(name, bits):
    codec = make_codec(name, 2, 128)
    x = torch.randn(5, 7, 2, 128)
    x_hat = codec.v.roundtrip(x)
    assert x_hat.shape == x.shape
    groups = x.reshape(5, 7, 2, 2, 64)  # group of 64 channels
    span = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
    bound = span / ((1 << bits) - 1) / 2 * 1.01 + 2e-3 * groups.abs().amax(-1, keepdim=True)
    assert ((x_hat.reshape(groups.shape) - groups).abs() <= bound).all()


def test_constant_and_zero_groups_are_exact():
    codec = make_codec("int4", 1, 64)
    x = torch.zeros(1, 16, 1, 64)
    x[..., 3] = 2.5
    assert torch.equal(codec.k.roundtrip(x), x)
    rows = torch.full((7, 1, 64), -1.5)
    rows[3] = 0
    assert torch.equal(codec.v.roundtrip(rows), rows)


def test_k_per_channel_beats_per_token_on_channel_outliers():
    codec = make_codec("int4", 2, 64)
    x = outlier_k()
    k_err = (codec.k.roundtrip(x) - x).pow(2).sum()
    v_err = (codec.v.roundtrip(x) - x).pow(2).sum()
    assert k_err < 0.5 * v_err


@pytest.mark.parametrize("name,bits", [("int4dq", 4), ("int3dq", 3), ("int2dq", 2)])
def test_k_with_8_bit_scales_widens_a_channel_s_range_and_never_clips_it(name, bits):
    codec = make_codec(name, 2, 64)
    x = outlier_k() + 5 * torch.randn(1, 1, 2, 64)  # per-channel offsets, as in Qwen's K
    packed = codec.k.encode(x)
    assert packed["scale"].dtype == packed["zero"].dtype == torch.uint8
    assert packed["zero_lo"].shape == (4, 2) and packed["zero_lo"].dtype == torch.float16
    x_hat = codec.k.decode(packed)
    lo, hi = x.amin(1), x.amax(1)  # [n, H, D]
    # decoded range: the zero is at most the channel's minimum (floored onto its grid) and the top
    # code reaches its maximum (the scale ceiled onto its grid)
    zero = codec.k.decode({**packed, "codes": torch.zeros_like(packed["codes"])})[:, 0]
    assert (zero <= lo + 1e-5).all()
    top = codec.k.decode({**packed, "codes": torch.full_like(packed["codes"], 255)})[:, 0]
    assert (top >= hi - 1e-4).all()
    # each value within half a step of the widened grid: a step is the range / (2^bits - 1) plus at
    # most one grid step of the zero and of the scale
    zero_step = packed["zero_step"].float().unsqueeze(-1)
    scale_step = packed["scale_step"].float().unsqueeze(-1)
    step = (hi - lo + zero_step) / ((1 << bits) - 1) + scale_step
    assert ((x_hat - x).abs() <= (step / 2 * 1.001 + 1e-5).unsqueeze(1)).all()


def test_8_bit_scales_cost_little_against_fp16_ones():
    x = outlier_k() + 5 * torch.randn(1, 1, 2, 64)
    err = {n: (make_codec(n, 2, 64).k.roundtrip(x) - x).pow(2).mean() for n in ("int3", "int3dq")}
    assert err["int3"] <= err["int3dq"] <= 1.2 * err["int3"]


def test_8_bit_scales_keep_zero_blocks_and_the_lowest_constant_channel_exact():
    codec = make_codec("int3dq", 1, 64)
    x = torch.zeros(2, 16, 1, 64)
    assert torch.equal(codec.k.roundtrip(x), x)
    x[0] = 2.5
    x[0, :, :, 3] = -1.25  # the head's lowest channel is its zero grid's origin: exact
    assert torch.equal(codec.k.roundtrip(x)[..., 3], x[..., 3])
