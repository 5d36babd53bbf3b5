"""Pack b-bit codes (b in 1..8) densely into bytes: each run of 8 codes becomes b bytes."""

from __future__ import annotations

import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] uint8 with values < 2**bits, n % 8 == 0 -> [..., n * bits // 8] uint8."""
    if bits == 8:
        return codes.to(torch.uint8)
    *lead, n = codes.shape
    assert n % 8 == 0, f"pack_bits needs a multiple of 8 codes, got {n}"
    device = codes.device
    groups = codes.reshape(*lead, n // 8, 8).to(torch.int64)
    word = (groups << (torch.arange(8, device=device) * bits)).sum(-1)  # [..., n/8], 8*bits bits used
    out = (word.unsqueeze(-1) >> (torch.arange(bits, device=device) * 8)) & 0xFF  # [..., n/8, bits]
    return out.to(torch.uint8).reshape(*lead, n // 8 * bits)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., m] uint8 -> [..., m * 8 // bits] uint8 codes."""
    if bits == 8:
        return packed
    *lead, m = packed.shape
    device = packed.device
    groups = packed.reshape(*lead, m // bits, bits).to(torch.int64)
    word = (groups << (torch.arange(bits, device=device) * 8)).sum(-1)  # [..., m/bits]
    codes = (word.unsqueeze(-1) >> (torch.arange(8, device=device) * bits)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(*lead, m // bits * 8)
