"""The codec interface: pure encode/decode of K or V into packed tensors plus metadata.

A `TensorCodec` encodes one of K or V. Per-token codecs (`per_token = True`) encode each token's
[num_kv_heads, head_dim] slice on its own, so `x` is [..., H, D] and every packed field is
[..., *token_shape]. Block codecs (KIVI's per-channel K) encode whole blocks: `x` is
[n, block_size, H, D] and every field is [n, *block_shape]. `decode` returns float32 of the
input's shape. A `KVCodec` pairs a K codec with a V codec and does the byte accounting.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

Packed = dict[str, torch.Tensor]
FieldSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TensorCodec(ABC):
    """Encodes K or V: x [n, block_size, H, D] -> fields [n, *field_specs(block_size) shape].

    Rules: `decode(encode(x))` is float32 of x's shape; every byte a block needs is a field listed
    in `field_specs`, so `bytes_per_block` is the honest storage cost.
    """

    per_token: bool = False

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    @abstractmethod
    def field_specs(self, block_size: int) -> FieldSpecs:
        """Per-block field shapes and dtypes."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Packed: ...

    @abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor: ...

    def bytes_per_block(self, block_size: int) -> int:
        specs = self.field_specs(block_size).values()
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


class PerTokenCodec(TensorCodec):
    """A codec whose tokens encode independently: x [..., H, D], fields [..., *token_shape]."""

    per_token = True

    @abstractmethod
    def token_specs(self) -> FieldSpecs:
        """Per-token field shapes and dtypes."""

    def field_specs(self, block_size: int) -> FieldSpecs:
        return {name: ((block_size, *shape), dtype) for name, (shape, dtype) in self.token_specs().items()}


@dataclass(frozen=True)
class KVCodec:
    """A named pair of K and V codecs for one layer's (num_kv_heads, head_dim)."""

    name: str
    k: TensorCodec
    v: TensorCodec
    passthrough_dtype: torch.dtype | None = None  # set for fp32/fp16/bf16: storage is dense

    @property
    def num_kv_heads(self) -> int:
        return self.k.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block, every scale, zero and norm included."""
        return self.k.bytes_per_block(block_size) + self.v.bytes_per_block(block_size)

    def bytes_per_token(self, block_size: int = 16) -> float:
        return self.bytes_per_block(block_size) / block_size

    def bits_per_element(self, block_size: int = 16) -> float:
        """Average over K and V of stored bits per value, metadata included."""
        return 8 * self.bytes_per_block(block_size) / (2 * block_size * self.num_kv_heads * self.head_dim)


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor as IEEE division on every device. CUDA computes a division by a Python scalar as a
    multiplication by its reciprocal, one ulp off at times, so codes and scales written on a GPU
    would differ from the CPU's and from the Triton writers (div_rn); a 0-dim tensor on x's device
    takes the true division everywhere."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def safe_scale(scale: torch.Tensor) -> torch.Tensor:
    """Zero (all-zero group) scales become 1 so division is exact and decodes to zeros."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))
