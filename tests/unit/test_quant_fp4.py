import torch

from kvserve.quant.fp4 import E2M1_VALUES, decode_e2m1, encode_e2m1
from kvserve.quant.registry import make_codec


def test_e2m1_grid_is_exact_and_rounds_to_nearest():
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    assert torch.equal(decode_e2m1(encode_e2m1(grid)), grid)
    rounded = decode_e2m1(encode_e2m1(torch.tensor([0.7, 2.6, 5.2, 100.0, -3.4])))
    assert rounded.tolist() == [0.5, 3.0, 6.0, 6.0, -3.0]


def test_nvfp4_layout_and_error_bound():
    codec = make_codec("nvfp4", 2, 64)
    x = torch.randn(6, 2, 64) * torch.linspace(0.01, 100, 6).view(6, 1, 1)
    packed = codec.v.encode(x)
    assert packed["codes"].shape == (6, 2, 32) and packed["scale"].shape == (6, 2, 4)
    assert torch.allclose(packed["global"], x.abs().amax((-2, -1)) / (6 * 448))
    step = packed["scale"].view(torch.float8_e4m3fn).float() * packed["global"].view(6, 1, 1)  # per 16
    err = (codec.v.decode(packed) - x).abs().reshape(6, 2, 4, 16)
    assert (err <= step.unsqueeze(-1) * 1.0001).all()  # E2M1 spacing <= 2 steps; e4m3 scale rounding


def test_mxfp4_floor_rule_and_error_bound():
    codec = make_codec("mxfp4", 1, 64)
    x = torch.randn(5, 1, 64)
    x[0, 0, :32] = 0.1
    x[0, 0, 0] = 5.0  # amax 5: exponent floor(log2 5) - 2 = 0
    packed = codec.k.encode(x)
    assert packed["scale"].shape == (5, 1, 2)
    assert packed["scale"][0, 0, 0] == 127
    amax = x.reshape(5, 1, 2, 32).abs().amax(-1)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    assert torch.equal(torch.exp2(packed["scale"].float() - 127), scale)
    err = (codec.k.decode(packed) - x).abs().reshape(5, 1, 2, 32)
    assert (err <= 2 * scale.unsqueeze(-1)).all()  # spacing 2 near the top, saturation at 6 < 8


def test_zero_blocks_decode_to_zero():
    for name in ("nvfp4", "mxfp4"):
        codec = make_codec(name, 1, 64)
        assert torch.equal(codec.v.roundtrip(torch.zeros(3, 1, 64)), torch.zeros(3, 1, 64))


def test_nvfp4_beats_mxfp4_on_gaussian():
    x = torch.randn(256, 2, 64)
    errs = {n: (make_codec(n, 2, 64).v.roundtrip(x) - x).pow(2).mean() for n in ("nvfp4", "mxfp4")}
    assert errs["nvfp4"] < errs["mxfp4"]
