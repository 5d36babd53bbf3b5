"""Unpacking a GGUF tensor's quantized blocks into codes, scales and offsets: gguf/quants.py's
dequantize_blocks, stopped before the multiply. Why the product is exact and the offsets are what they
are: models/gguf_codes.py's docstring, which holds the table of formats."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

_CHUNK = 1 << 22  # elements unpacked at a time: bounds the temporaries

_Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [n, block] int8, scale, offset [n, groups]
_NIBBLES = np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _neg_zero(like: np.ndarray) -> np.ndarray:
    return np.full(like.shape, -0.0, dtype=np.float32)


def _q8_0(blocks: np.ndarray) -> _Unpacked:
    d, x = np.split(blocks, [2], axis=1)
    d = _f16(d)
    return x.view(np.int8).copy(), d, _neg_zero(d)


def _q4_0(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    d, qs = np.hsplit(blocks, [2])
    d = _f16(d)
    qs = qs.reshape((n, -1, 1, 16)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1)).astype(np.int8) - np.int8(8)
    return q, d, _neg_zero(d)


def _q4_1(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    d, rest = np.hsplit(blocks, [2])
    m, qs = np.hsplit(rest, [2])
    qs = qs.reshape((n, -1, 1, 16)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1)).astype(np.int8)
    return q, _f16(d), _f16(m)


def _q5_low_high(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 32 five-bit values from a little-endian uint32 of high bits and 16 bytes of nibbles."""
    n = qs.shape[0]
    qh = qh.view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    ql = qs.reshape((n, -1, 1, 16)) >> _NIBBLES
    qh = (qh & np.uint32(0x01)).astype(np.uint8)
    ql = (ql & np.uint8(0x0F)).reshape((n, -1))
    return ql | (qh << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> _Unpacked:
    d, rest = np.hsplit(blocks, [2])
    qh, qs = np.hsplit(rest, [4])
    d = _f16(d)
    return _q5_low_high(qh, qs).astype(np.int8) - np.int8(16), d, _neg_zero(d)


def _q5_1(blocks: np.ndarray) -> _Unpacked:
    d, rest = np.hsplit(blocks, [2])
    m, rest = np.hsplit(rest, [2])
    qh, qs = np.hsplit(rest, [4])
    return _q5_low_high(qh, qs).astype(np.int8), _f16(d), _f16(m)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d*sc, -(dmin*m)) [n, 8] and the rest of the block."""
    from gguf.quants import Q4_K

    d, rest = np.hsplit(blocks, [2])
    dmin, rest = np.hsplit(rest, [2])
    scales, rest = np.hsplit(rest, [Q4_K.K_SCALE_SIZE])
    d = _f16(d)
    dmin = _f16(dmin)
    sc, m = Q4_K.get_scale_min(scales)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), rest


def _q4_k(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    a, o, qs = _k_scales(blocks)
    qs = qs.reshape((n, -1, 1, 32)) >> _NIBBLES
    q = (qs & np.uint8(0x0F)).reshape((n, -1)).astype(np.int8)
    return q, a, o


def _q5_k(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    a, o, rest = _k_scales(blocks)
    qh, qs = np.hsplit(rest, [256 // 8])
    ql = qs.reshape((n, -1, 1, 32)) >> _NIBBLES
    qh = qh.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    ql = (ql & np.uint8(0x0F)).reshape((n, -1, 32))
    qh = (qh & np.uint8(0x01)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).reshape((n, -1)).astype(np.int8)
    return q, a, o


def _q6_k(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    ql, rest = np.hsplit(blocks, [256 // 2])
    qh, rest = np.hsplit(rest, [256 // 4])
    scales, d = np.hsplit(rest, [256 // 16])
    a = _f16(d) * scales.view(np.int8).astype(np.float32)  # [n, 16]
    ql = ql.reshape((n, -1, 1, 64)) >> _NIBBLES
    ql = (ql & np.uint8(0x0F)).reshape((n, -1, 32))
    qh = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = (qh & np.uint8(0x03)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape((n, -1)), a, _neg_zero(a)


# type -> (elements per block, bytes per block, group, unpack)
_FORMATS: dict[QT, tuple[int, int, int, Callable[[np.ndarray], _Unpacked]]] = {
    QT.Q8_0: (32, 34, 32, _q8_0),
    QT.Q4_0: (32, 18, 32, _q4_0),
    QT.Q4_1: (32, 20, 32, _q4_1),
    QT.Q5_0: (32, 22, 32, _q5_0),
    QT.Q5_1: (32, 24, 32, _q5_1),
    QT.Q4_K: (256, 144, 32, _q4_k),
    QT.Q5_K: (256, 176, 32, _q5_k),
    QT.Q6_K: (256, 210, 16, _q6_k),
}
GROUPS: dict[QT, int] = {t: g for t, (_, _, g, _) in _FORMATS.items()}  # the types with codes


def unpack(data: np.ndarray, qtype: QT | int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw bytes, [rows, bytes per row] uint8 as gguf.GGUFReader gives them, as numpy
    (codes int8 [rows, in], scale float32 [rows, in / g], offset float32 [rows, in / g]). Raises
    ValueError for a type without codes (see GROUPS)."""
    qtype = QT(qtype)
    if qtype not in _FORMATS:
        raise ValueError(
            f"GGUF type {qtype.name} has no codes (codes exist for {', '.join(t.name for t in _FORMATS)})"
        )
    block, size, group, fn = _FORMATS[qtype]
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % size:
        raise ValueError(f"{qtype.name} data must be [rows, k * {size}] uint8, got {data.dtype} {data.shape}")
    rows, n_in = data.shape[0], data.shape[1] // size * block
    codes = np.empty((rows, n_in), dtype=np.int8)
    scale = np.empty((rows, n_in // group), dtype=np.float32)
    offset = np.empty_like(scale)
    step = max(1, _CHUNK // max(n_in, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q, a, o = fn(np.ascontiguousarray(data[r0:r1]).reshape((-1, size)))
        codes[r0:r1] = q.reshape((r1 - r0, n_in))
        scale[r0:r1] = a.reshape((r1 - r0, -1))
        offset[r0:r1] = o.reshape((r1 - r0, -1))
    return codes, scale, offset


# type -> byte offsets, inside a block, of its fp16 fields (d, and m or dmin where there is one)
F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def random_blocks(qtype: QT, rows: int, n_in: int, seed: int = 0, sign: float = 1.0) -> np.ndarray:
    """A tensor's raw GGUF bytes [rows, bytes per row] uint8 with random codes and sub-scales and finite
    fp16 block scales of `sign` times [1e-4, 0.02): what `unpack` reads, for tests and benchmarks."""
    block, size, _, _ = _FORMATS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, n_in // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (sign * (rng.random((rows, n_in // block)) * 0.02 + 1e-4)).astype(np.float16)
        data[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, n_in // block, 2)
    return data.reshape(rows, -1)
