"""fp32 / fp16 / bf16: values stored as they are (the storage factory uses dense storage)."""

from __future__ import annotations

import torch

from kvserve.quant.base import FieldSpecs, Packed, PerTokenCodec


class PassthroughCodec(PerTokenCodec):
    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(num_kv_heads, head_dim)
        self.dtype = dtype

    def token_specs(self) -> FieldSpecs:
        return {"x": ((self.num_kv_heads, self.head_dim), self.dtype)}

    def encode(self, x: torch.Tensor) -> Packed:
        return {"x": x.to(self.dtype)}

    def decode(self, packed: Packed) -> torch.Tensor:
        return packed["x"].float()
