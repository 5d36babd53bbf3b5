"""How a linear's GGUF codes are packed for `row_linear_qcodes` (csrc/cpu/linear_qcodes.cpp): the same
weights as models/gguf_codes.py's Codes, W = fl(A * C + O) bitwise, from fewer bytes.

    layout = choose_layout([codes_q, codes_k, codes_v])   # one layout for weights fused into one call
    packed = pack(ext, codes_q, layout)                   # uint8 [panels, row bytes]

The codes C are stored as u = C - zero in `bits` bits (4, 5 or 6 where every code fits, else 8 as they
are), and the factors of each group as compactly as they can be recomputed bit for bit:

    f16    A and O are fp16 values (Q8_0, Q4_0, Q5_0: A = d; Q4_1, Q5_1: O = m)
    super  A = D * s, O = E * t with D, E fp32 per super-block of 256 inputs and s, t int8 per group
           (Q4_K, Q5_K: d * sc and -(dmin * m); Q6_K: d * scale). The product is exact, so the kernel's
           fp32 multiply gives A bitwise: `super_factors` finds D and s and checks that it does.
    f32    A and O as they are (anything else)

and O is left out when every offset is -0.0 (the formats without one), the kernel then using -0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kvserve.models.gguf_codes import Codes, regroup

FACTOR_KINDS = {"f32": 0, "f16": 1, "super": 2}  # linear_qcodes.cpp Kind
SUPER_BLOCK = 256  # inputs of a K-quant super-block
_STEPS_PER_WORD = {4: 16, 5: 32, 6: 16, 8: 16}  # in_features must be a multiple (linear_qcodes.cpp words)


@dataclass(frozen=True)
class CodeLayout:
    """How a weight's codes are packed: C = u + zero with u in `bits` bits; per group of `group` inputs
    A and O as `factors` says; no stored O when `offsets` is False."""

    bits: int
    zero: int
    group: int
    factors: str
    offsets: bool

    @property
    def super_groups(self) -> int:
        return SUPER_BLOCK // self.group if self.factors == "super" else 0

    def describe(self) -> str:
        return f"{self.bits}-bit codes, {self.factors} factors{'' if self.offsets else ' (no offsets)'}, group {self.group}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _no_offsets(c: Codes) -> bool:
    return bool((c.offset.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all())


def _fp16_exact(t: torch.Tensor) -> bool:
    return same_bits(t.half().float(), t)


def super_factors(values: torch.Tensor, super_groups: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values fp32 [out, groups] as D fp32 [out, groups / super_groups] times s int8 [out, groups], with
    fl(D * s) == values bitwise; None when no such pair exists here. D is the largest common factor of a
    super-block's values (their integer mantissas' gcd at the smallest exponent), negative where that
    is what gives -0.0 = D * 0 or keeps s within int8."""
    out, groups = values.shape
    if super_groups <= 0 or groups % super_groups:
        return None
    v = values.numpy().reshape(out, groups // super_groups, super_groups)
    if not np.isfinite(v).all():
        return None
    m, e = np.frexp(v)  # v = m * 2^e, |m| in [0.5, 1): m * 2^24 is v's integer mantissa
    n = (m.astype(np.float64) * 2.0**24).astype(np.int64)
    nonzero = n != 0
    e = np.where(nonzero, e, np.iinfo(np.int32).max)
    e_min = e.min(axis=2, keepdims=True)
    e_min = np.where(e_min == np.iinfo(np.int32).max, 0, e_min)  # all zero: any D
    shift = np.where(nonzero, e - e_min, 0)
    if shift.max(initial=0) > 36:  # values of a super-block too far apart for int8 multiples
        return None
    scaled = n << shift  # [out, supers, S]: values = scaled * 2^(e_min - 24)
    g = np.gcd.reduce(np.abs(scaled), axis=2, keepdims=True)
    g = np.where(g == 0, 1, g)
    s = scaled // g  # with D > 0
    # D's sign: D * 0 keeps it, so a -0.0 needs D < 0 and a +0.0 D > 0; and s must stay within int8 (Q6_K
    # stores d < 0 with sub-scales down to -128)
    zero = v == 0
    fits_pos = (s.max(axis=2, keepdims=True) <= 127) & (s.min(axis=2, keepdims=True) >= -128)
    fits_neg = (s.max(axis=2, keepdims=True) <= 128) & (s.min(axis=2, keepdims=True) >= -127)
    pos_ok = fits_pos & ~(zero & np.signbit(v)).any(axis=2, keepdims=True)
    neg_ok = fits_neg & ~(zero & ~np.signbit(v)).any(axis=2, keepdims=True)
    negative = neg_ok & (~pos_ok | np.signbit(v).all(axis=2, keepdims=True))
    g, s = np.where(negative, -g, g), np.where(negative, -s, s)
    if s.min(initial=0) < -128 or s.max(initial=0) > 127 or np.abs(g).max() >= 2**53:
        return None
    d = np.ldexp(g.astype(np.float64), (e_min - 24).astype(np.int32))
    d32 = d.astype(np.float32)
    if not (d32.astype(np.float64) == d).all():
        return None
    big = torch.from_numpy(d32[..., 0].copy())  # [out, supers]
    small = torch.from_numpy(s.astype(np.int8).reshape(out, groups))
    product = (big.repeat_interleave(super_groups, dim=1) * small.float()).contiguous()
    return (big, small) if same_bits(product, values) else None


def choose_layout(codes: list[Codes]) -> CodeLayout:
    """The most compact layout that packs every one of `codes` (weights of one input dimension, run as
    one call: their rows concatenated) bit for bit: the smallest group among them, the fewest bits that
    hold every code, the most compact factors that all of them recompute exactly."""
    group = min(c.group for c in codes)
    regrouped = [regroup(c, group) for c in codes]
    n_in = codes[0].codes.shape[1]
    # 0 among the codes: the kernel's padded outputs have C = 0
    low = min(0, *(int(c.codes.min()) for c in codes))
    high = max(0, *(int(c.codes.max()) for c in codes))
    bits, zero = 8, 0
    for b in (4, 5, 6):
        if high - low < 2**b and n_in % _STEPS_PER_WORD[b] == 0:
            bits, zero = b, low
            break
    offsets = not all(_no_offsets(c) for c in regrouped)
    factors = "f32"
    if all(_fp16_exact(c.scale) and (not offsets or _fp16_exact(c.offset)) for c in regrouped):
        factors = "f16"
    elif n_in % SUPER_BLOCK == 0 and all(
        super_factors(c.scale, SUPER_BLOCK // group) is not None
        and (not offsets or super_factors(c.offset, SUPER_BLOCK // group) is not None)
        for c in regrouped
    ):
        factors = "super"
    return CodeLayout(bits, zero, group, factors, offsets)


def pack(ext: ModuleType, c: Codes, layout: CodeLayout) -> torch.Tensor:
    """c packed in `layout` (one choose_layout gave for it): uint8 [panels, row bytes]."""
    c = regroup(c, layout.group)
    o = c.offset if layout.offsets else None
    a_sub = o_sub = None
    if layout.factors == "f16":
        a, o = c.scale.half(), None if o is None else o.half()
    elif layout.factors == "super":
        a, a_sub = _factored(c.scale, layout.super_groups)
        if o is not None:
            o, o_sub = _factored(o, layout.super_groups)
    else:
        a = c.scale
    kind = FACTOR_KINDS[layout.factors]
    return ext.pack_linear_qcodes(
        c.codes, layout.bits, layout.zero, layout.group, kind, layout.super_groups, a, o, a_sub, o_sub
    )


def _factored(values: torch.Tensor, super_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    pair = super_factors(values, super_groups)
    if pair is None:
        raise ValueError("these factors have no exact super-block form (choose_layout did not choose it)")
    return pair
