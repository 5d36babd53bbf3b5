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
