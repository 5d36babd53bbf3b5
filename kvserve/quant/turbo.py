"""TurboQuant-style KV (arXiv 2504.19874), MSE stage only (no QJL residual: it hurts attention).

Each [head_dim] vector: store its L2 norm (fp16); rotate it with a randomized Hadamard transform
(random signs, then an orthonormal Walsh-Hadamard matrix; fixed seed per layer and kv-head); scale
the unit vector by sqrt(head_dim) so coordinates are ~N(0, 1); quantize each coordinate with the
Lloyd-Max codebook for N(0, 1); bit-pack. `splits` assigns code widths to runs of rotated
coordinates: ((D, 4),) is turbo4; ((D/2, 4), (D/2, 3)) is the 3.5-bit outlier split. The rotation
spreads outlier channels evenly over all rotated coordinates, so the wider codes can sit on a fixed
run of them and no per-vector channel indices are stored.
"""

from __future__ import annotations

import math

import torch

from kvserve.quant.base import FieldSpecs, Packed, PerTokenCodec
from kvserve.quant.bitpack import pack_bits, unpack_bits
from kvserve.quant.lloyd_max import lloyd_max_normal


def hadamard_matrix(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix [n, n] fp32 (n a power of two); symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotation_signs(num_kv_heads: int, head_dim: int, layer_idx: int) -> torch.Tensor:
    """[H, D] fp32 of +-1, fixed per (layer, kv-head)."""
    rows = []
    for head in range(num_kv_heads):
        gen = torch.Generator().manual_seed(0x7B0 + 1009 * layer_idx + head)
        rows.append(torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1)
    return torch.stack(rows)


class TurboCodec(PerTokenCodec):
    def __init__(self, num_kv_heads: int, head_dim: int, splits: tuple[tuple[int, int], ...], layer_idx: int):
        super().__init__(num_kv_heads, head_dim)
        assert sum(n for n, _ in splits) == head_dim
        self.splits = splits
        self.signs = rotation_signs(num_kv_heads, head_dim, layer_idx)  # [H, D]
        self.hadamard = hadamard_matrix(head_dim)  # [D, D]
        self.codebooks = [torch.tensor(lloyd_max_normal(bits)[0]) for _, bits in splits]

    def token_specs(self) -> FieldSpecs:
        h = self.num_kv_heads
        specs: FieldSpecs = {
            f"codes{i}": ((h, n * b // 8), torch.uint8) for i, (n, b) in enumerate(self.splits)
        }
        specs["norm"] = ((h,), torch.float16)
        return specs

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.signs.to(x.device)) @ self.hadamard.to(x.device)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return (y @ self.hadamard.to(y.device)) * self.signs.to(y.device)

    def encode(self, x: torch.Tensor) -> Packed:
        x = x.float()
        norm = x.norm(dim=-1).half()  # [..., H]
        scale = math.sqrt(self.head_dim) / norm.float().clamp_min(1e-30)
        unit = self.rotate(x) * scale.unsqueeze(-1)  # [..., H, D] ~N(0, 1) coordinates
        packed: Packed = {"norm": norm}
        start = 0
        for i, ((n, bits), centroids) in enumerate(zip(self.splits, self.codebooks, strict=True)):
            centroids = centroids.to(x.device)
            edges = (centroids[1:] + centroids[:-1]) / 2
            codes = torch.bucketize(unit[..., start : start + n].contiguous(), edges).to(torch.uint8)
            packed[f"codes{i}"] = pack_bits(codes, bits)
            start += n
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        parts = []
        for i, ((_, bits), centroids) in enumerate(zip(self.splits, self.codebooks, strict=True)):
            codes = unpack_bits(packed[f"codes{i}"], bits)
            parts.append(centroids.to(codes.device)[codes.long()])
        unit = torch.cat(parts, dim=-1)  # [..., H, D]
        scale = packed["norm"].float() / math.sqrt(self.head_dim)
        return self.unrotate(unit * scale.unsqueeze(-1))
