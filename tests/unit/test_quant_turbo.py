import pytest
import torch

from kvserve.quant.lloyd_max import lloyd_max_normal
from kvserve.quant.registry import make_codec
from kvserve.quant.turbo import hadamard_matrix


def test_lloyd_max_matches_published_codebooks():
    centroids, mse = lloyd_max_normal(3)
    assert [round(c, 4) for c in centroids[4:]] == [0.2451, 0.756, 1.3439, 2.1519]
    assert abs(mse - 0.03455) < 1e-4
    assert abs(lloyd_max_normal(4)[1] - 0.0095) < 1e-4


def test_rotation_is_orthonormal_and_seeded_per_layer_and_head():
    h = hadamard_matrix(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-5)
    a, b = make_codec("turbo4", 2, 64, layer_idx=3), make_codec("turbo4", 2, 64, layer_idx=3)
    c = make_codec("turbo4", 2, 64, layer_idx=4)
    assert torch.equal(a.k.signs, b.k.signs) and not torch.equal(a.k.signs, c.k.signs)
    assert not torch.equal(a.k.signs[0], a.k.signs[1])
    x = torch.randn(5, 2, 64)
    assert torch.allclose(a.k.unrotate(a.k.rotate(x)), x, atol=1e-5)


@pytest.mark.parametrize(
    "name,mse", [("turbo4", 0.0095), ("turbo3.5", (0.0095 + 0.03455) / 2), ("turbo3", 0.03455)]
)
def test_relative_mse_near_lloyd_max_even_with_outlier_channels(name, mse):
    codec = make_codec(name, 2, 128, layer_idx=1)
    x = torch.randn(512, 2, 128)
    x[..., :8] *= 10  # outlier channels: the rotation spreads them
    x_hat = codec.k.roundtrip(x)
    rel = ((x_hat - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean()
    assert 0.8 * mse < rel < 1.2 * mse


def test_layout_and_norm():
    codec = make_codec("turbo3.5", 3, 64)
    x = torch.randn(7, 3, 64)
    packed = codec.v.encode(x)
    assert packed["codes0"].shape == (7, 3, 16) and packed["codes1"].shape == (7, 3, 12)
    assert torch.allclose(packed["norm"].float(), x.norm(dim=-1), rtol=1e-3)
    assert torch.equal(codec.v.roundtrip(torch.zeros(2, 3, 64)), torch.zeros(2, 3, 64))
