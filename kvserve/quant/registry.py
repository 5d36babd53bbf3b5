"""KV codecs by config name (`kv_cache_dtype`), with the checks that make a name usable."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.errors import ConfigError
from kvserve.quant.base import KVCodec
from kvserve.quant.fp4 import Mxfp4Codec, Nvfp4Codec
from kvserve.quant.fp8 import Fp8Codec
from kvserve.quant.kivi import KiviKeyCodec, KiviValueCodec
from kvserve.quant.passthrough import PassthroughCodec
from kvserve.quant.turbo import TurboCodec

PASSTHROUGH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KIVI_BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
# KIVI with K's per-channel scale and zero stored as 8-bit codes (kivi.KiviKeyCodec meta_bits 8): 1 bit
# per K value instead of 2 at 16-token blocks. V is KIVI's (its fp16 scale and zero are per 64 channels).
KIVI_DQ_BITS = {"int4dq": 4, "int3dq": 3, "int2dq": 2}
TURBO_SPLITS = {
    "turbo4": ((1, 4),),
    "turbo3.5": ((2, 4), (2, 3)),
    "turbo3": ((1, 3),),
    "turbo2.5": ((2, 3), (2, 2)),
    "turbo2": ((1, 2),),
}  # (1/share, bits)
# K from one codec, V from another: (K codec, V codec). KIVI's per-channel K beats a rotation at the same
# width (it keeps K's per-channel offsets out of the codes), a rotation beats KIVI's per-token V. The
# premise that K deserves the wider codes held only in part: V at 2 bits costs SmolLM2's answers too
# (docs/kv-quality.md).
MIXED_KV = {
    "kturbo4-vturbo2": ("turbo4", "turbo2"),
    "kturbo3-vturbo2": ("turbo3", "turbo2"),
    "kint4-vturbo2": ("int4", "turbo2"),
    "kint3-vturbo3": ("int3", "turbo3"),
    "kint3-vturbo2": ("int3", "turbo2"),
    "kint2-vturbo2": ("int2", "turbo2"),
    "kint3dq-vturbo3": ("int3dq", "turbo3"),
    "kint3dq-vturbo2.5": ("int3dq", "turbo2.5"),
    "kint3dq-vturbo2": ("int3dq", "turbo2"),
}


def head_dim_problem(name: str, head_dim: int) -> str | None:
    """What `name` needs of head_dim that it does not get, or None when it can pack head_dim."""
    if (name in KIVI_BITS or name in KIVI_DQ_BITS) and head_dim % 16:
        return "head_dim a multiple of 16"
    if name in ("nvfp4", "mxfp4"):
        block = Nvfp4Codec.block if name == "nvfp4" else Mxfp4Codec.block
        if head_dim % block:
            return f"head_dim a multiple of its {block}-value scale block"
    if name in MIXED_KV:
        return next((p for part in MIXED_KV[name] if (p := head_dim_problem(part, head_dim))), None)
    if name in TURBO_SPLITS and (head_dim < 16 or head_dim & (head_dim - 1)):
        return "head_dim a power of two >= 16 (Hadamard rotation)"
    return None


def _passthrough(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    dtype = PASSTHROUGH_DTYPES[name]
    return KVCodec(
        name, PassthroughCodec(h, d, dtype), PassthroughCodec(h, d, dtype), passthrough_dtype=dtype
    )


def _kivi(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    bits, meta_bits = (KIVI_BITS[name], 16) if name in KIVI_BITS else (KIVI_DQ_BITS[name], 8)
    group = next(g for g in (64, 32, 16) if d % g == 0)  # V channels sharing one scale and zero
    return KVCodec(name, KiviKeyCodec(h, d, bits, meta_bits), KiviValueCodec(h, d, bits, group))


def _fp8(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    return KVCodec(name, Fp8Codec(h, d), Fp8Codec(h, d))


def _fp4(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    cls = Nvfp4Codec if name == "nvfp4" else Mxfp4Codec
    return KVCodec(name, cls(h, d), cls(h, d))


def _turbo(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    splits = tuple((d // share, bits) for share, bits in TURBO_SPLITS[name])
    return KVCodec(name, TurboCodec(h, d, splits, layer_idx), TurboCodec(h, d, splits, layer_idx))


def _mixed(name: str, h: int, d: int, layer_idx: int) -> KVCodec:
    k_name, v_name = MIXED_KV[name]
    k = _BUILDERS[k_name](k_name, h, d, layer_idx).k
    return KVCodec(name, k, _BUILDERS[v_name](v_name, h, d, layer_idx).v)


_BUILDERS: dict[str, Callable[[str, int, int, int], KVCodec]] = {
    **dict.fromkeys(PASSTHROUGH_DTYPES, _passthrough),
    **dict.fromkeys(KIVI_BITS, _kivi),
    **dict.fromkeys(KIVI_DQ_BITS, _kivi),
    "fp8_e4m3": _fp8,
    "nvfp4": _fp4,
    "mxfp4": _fp4,
    **dict.fromkeys(TURBO_SPLITS, _turbo),
    **dict.fromkeys(MIXED_KV, _mixed),
}
CODEC_NAMES = tuple(_BUILDERS)


def make_codec(name: str, num_kv_heads: int, head_dim: int, layer_idx: int = 0) -> KVCodec:
    """The codec `name` for one layer; turbo codecs seed their rotation with `layer_idx`."""
    if name not in _BUILDERS:
        raise ConfigError(
            f"unknown kv_cache_dtype {name!r}; choose one of: auto, {', '.join(CODEC_NAMES)}",
            param="kv_cache_dtype",
        )
    need = head_dim_problem(name, head_dim)
    if need is not None:
        works = [n for n in CODEC_NAMES if head_dim_problem(n, head_dim) is None]
        raise ConfigError(
            f"kv_cache_dtype={name!r} needs {need} (got head_dim {head_dim}); "
            f"formats that work with head_dim {head_dim}: {', '.join(works)}",
            param="kv_cache_dtype",
        )
    return _BUILDERS[name](name, num_kv_heads, head_dim, layer_idx)
