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


def on_grid(code: torch.Tensor, step: torch.Tensor, origin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """origin + code * step in fp32: a value of an 8-bit grid, the same in encode and decode."""
    return origin + code.float() * step.float()


def round_down_half(x: torch.Tensor) -> torch.Tensor:
    """x in fp16, rounded toward -inf (at most x)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


class KiviKeyCodec(TensorCodec):
    """Block codec: x [n, block_size, H, D]; scale and zero per (block, head, channel).

    meta_bits 16: scale and zero in fp16, KIVI's own (4 bytes a channel a block: 2 bits per value at
    16-token blocks, as much as int2's codes). meta_bits 8 ("double quantization", as QLoRA does for
    its weight scales): each is a uint8 code on a per-(block, head) fp16 grid, 1 bit per value. The
    zero is rounded down onto its grid and the scale up onto its grid before the codes are computed
    against them, so the coarser metadata widens a channel's range a little and never clips it.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, bits: int, meta_bits: int = 16):
        super().__init__(num_kv_heads, head_dim)
        assert meta_bits in (8, 16)
        self.bits, self.meta_bits = bits, meta_bits

    def field_specs(self, block_size: int) -> FieldSpecs:
        h, d = self.num_kv_heads, self.head_dim
        codes: FieldSpecs = {"codes": ((block_size, h, d * self.bits // 8), torch.uint8)}
        if self.meta_bits == 16:
            return codes | {"scale": ((h, d), torch.float16), "zero": ((h, d), torch.float16)}
        grid = {name: ((h,), torch.float16) for name in ("zero_lo", "zero_step", "scale_step")}
        return codes | {"scale": ((h, d), torch.uint8), "zero": ((h, d), torch.uint8)} | grid

    def encode(self, x: torch.Tensor) -> Packed:
        if self.meta_bits == 16:
            codes, scale, zero = quantize_asym(x, dim=-3, bits=self.bits)  # codes [n, bs, H, D]
            return {
                "codes": pack_bits(codes, self.bits),
                "scale": scale.squeeze(-3),
                "zero": zero.squeeze(-3),
            }
        x = x.float()
        lo, hi = x.amin(-3), x.amax(-3)  # [n, H, D]
        zero_lo = round_down_half(lo.amin(-1, keepdim=True))  # [n, H, 1]
        zero_step = safe_scale(divide(lo.amax(-1, keepdim=True) - zero_lo.float(), 255).half().float())
        zero_code = torch.floor((lo - zero_lo.float()) / zero_step).clamp_(0, 255)
        zero = on_grid(zero_code, zero_step, zero_lo.float())  # at most lo, as decode computes it
        qmax = (1 << self.bits) - 1
        scale = divide(hi - zero, qmax)
        # One part in 1024 over the largest scale / 255, so fp16 rounding cannot put a channel off the grid.
        scale_step = safe_scale((divide(scale.amax(-1, keepdim=True), 255) * (1 + 2**-10)).half().float())
        scale_code = torch.ceil(scale / scale_step).clamp_(0, 255)
        step = safe_scale(on_grid(scale_code, scale_step)).unsqueeze(-3)
        codes = torch.round((x - zero.unsqueeze(-3)) / step).clamp_(0, qmax).to(torch.uint8)
        return {
            "codes": pack_bits(codes, self.bits),
            "scale": scale_code.to(torch.uint8),
            "zero": zero_code.to(torch.uint8),
            "zero_lo": zero_lo.squeeze(-1),
            "zero_step": zero_step.half().squeeze(-1),
            "scale_step": scale_step.half().squeeze(-1),
        }

    def decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed["codes"], self.bits).float()  # [n, bs, H, D]
        if self.meta_bits == 16:
            return codes * packed["scale"].float().unsqueeze(-3) + packed["zero"].float().unsqueeze(-3)
        grid = {name: packed[name].float().unsqueeze(-1) for name in ("zero_lo", "zero_step", "scale_step")}
        zero = on_grid(packed["zero"], grid["zero_step"], grid["zero_lo"])
        scale = on_grid(packed["scale"], grid["scale_step"])
        return codes * scale.unsqueeze(-3) + zero.unsqueeze(-3)


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
