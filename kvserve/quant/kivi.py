"""KIVI integer KV (arXiv 2402.02750): asymmetric min/max quantization, fp16 scale and zero.

K is quantized per channel with one block of tokens as the group (K outliers live in fixed
channels, so a channel's range over tokens is tight); V per token with channel groups.
x_hat = code * scale + zero, code in [0, 2**bits - 1].
"""

from __future__ import annotations

import torch

from kvserve.quant.base import FieldSpecs, Packed, PerTokenCodec, TensorCodec, divide, safe_scale
from kvserve.quant.bitpack import pack_bits, unpack_bits


def quantize_asym(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantization along `dim` -> (codes uint8, scale fp16, zero fp16), scale/zero keep dim."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    qmax = (1 << bits) - 1
    zero = lo.half()
    scale = divide(hi - zero.float(), qmax).half()
    # Quantize against the fp16-rounded scale and zero that decode will use.
    codes = torch.round((x - zero.float()) / safe_scale(scale.float())).clamp_(0, qmax).to(torch.uint8)
    return codes, scale, zero


class KiviKeyCodec(TensorCodec):
    """Block codec: x [n, block_size, H, D]; scale and zero per (block, head, channel)."""

    def __init__(self, num_kv_heads: int, head_dim: int, bits: int):
        super().__init__(num_kv_heads, head_dim)
        self.bits = bits

    def field_specs(self, block_size: int) -> FieldSpecs:
        h, d = self.num_kv_heads, self.head_dim
        return {
            "codes": ((block_size, h, d * self.bits // 8), torch.uint8),
            "scale": ((h, d), torch.float16),
            "zero": ((h, d), torch.float16),
        }

    def encode(self, x: torch.Tensor) -> Packed:
        codes, scale, zero = quantize_asym(x, dim=-3, bits=self.bits)  # codes [n, bs, H, D]
        return {"codes": pack_bits(codes, self.bits), "scale": scale.squeeze(-3), "zero": zero.squeeze(-3)}

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed["codes"], self.bits).float()  # [n, bs, H, D]
        return codes * packed["scale"].float().unsqueeze(-3) + packed["zero"].float().unsqueeze(-3)


class KiviValueCodec(PerTokenCodec):
    """Per-token codec: scale and zero per (token, head, group of `group_size` channels)."""

    def __init__(self, num_kv_heads: int, head_dim: int, bits: int, group_size: int):
        super().__init__(num_kv_heads, head_dim)
        self.bits, self.group_size = bits, group_size
        self.num_groups = head_dim // group_size

    def token_specs(self) -> FieldSpecs:
        h, d, g = self.num_kv_heads, self.head_dim, self.num_groups
        return {
            "codes": ((h, d * self.bits // 8), torch.uint8),
            "scale": ((h, g), torch.float16),
            "zero": ((h, g), torch.float16),
        }

    def encode(self, x: torch.Tensor) -> Packed:
        grouped = x.reshape(*x.shape[:-1], self.num_groups, self.group_size)  # [..., H, G, gs]
        codes, scale, zero = quantize_asym(grouped, dim=-1, bits=self.bits)
        codes = pack_bits(codes.reshape(x.shape), self.bits)
        return {"codes": codes, "scale": scale.squeeze(-1), "zero": zero.squeeze(-1)}

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed["codes"], self.bits).float()  # [..., H, D]
        grouped = codes.reshape(*codes.shape[:-1], self.num_groups, self.group_size)
        x = grouped * packed["scale"].float().unsqueeze(-1) + packed["zero"].float().unsqueeze(-1)
        return x.reshape(codes.shape)
