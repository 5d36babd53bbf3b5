"""The kvserve CUDA extension (csrc/): JIT-built once with torch.utils.cpp_extension.load, then cached.

`load()` builds on first use (about a minute; torch caches the build under TORCH_EXTENSIONS_DIR and
rebuilds only when a source changes). `paged_attention(...)` checks its arguments, plans split-KV and
launches on the current stream.

Pools the kernel reads in place (`KV_FORMATS`, KvFormat in csrc/attention/paged_attention.h): dense
fp16 / bf16, fp8_e4m3 (uint8 e4m3 codes + one fp32 scale per token and kv head) and int8 KIVI
(uint8 codes; K scale / zero per block and channel, open blocks' K in full precision; V scale / zero
per token and group of 64 channels). `kvserve.kernels.paged_kv` collects those tensors from a `LayerKV`;
kvserve/attention/cuda_backend.py takes a dense copy of pools in any other format.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from kvserve.kernels.checks import check_paged_args, check_scales, require

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ["bindings.cpp", "attention/paged_attention.cu", "attention/merge_splits.cu"]
HEADERS = ["attention/paged_attention.h", "attention/mma.cuh", "attention/kv_tile.cuh"]
KV_TILE = 64  # kKvTile in csrc/attention/paged_attention.h
KV_FORMATS = {"dense": 0, "fp8_e4m3": 1, "int8": 2}  # name -> kvserve::KvFormat
KIVI_V_GROUP = 64  # kKiviVGroup: V channels sharing one scale and zero in int8 pools
COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


def unavailable_reason() -> str:
    """'' when the extension can be built and run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"needs compute capability >= 8.0 (mma.sync bf16), got {torch.cuda.get_device_capability()}"
    if not all((CSRC / s).exists() for s in SOURCES + HEADERS):
        return f"CUDA sources missing under {CSRC}"
    return ""


def is_available() -> tuple[bool, str]:
    """(True, '') when the extension can be built and run here, else (False, why); does not build."""
    reason = unavailable_reason()
    return not reason, reason


def _arch_flags() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


@functools.cache
def load() -> ModuleType:
    """Builds (or loads the cached build of) the extension; RuntimeError if it cannot run here."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"kvserve CUDA extension unavailable: {reason}")
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(
        name="kvserve_cuda_ext",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math", *_arch_flags()],
        verbose=os.environ.get("KVSERVE_VERBOSE_BUILD") == "1",
    )


def plan_splits(num_ctas: int, max_seq_len: int, num_sms: int, ctas_per_sm: int = 2) -> tuple[int, int]:
    """(num_splits, tokens_per_split): split the KV until about `ctas_per_sm` CTAs per SM, never below
    one tile."""
    max_tiles = max(1, -(-max_seq_len // KV_TILE))
    num_splits = min(max_tiles, max(1, -(-ctas_per_sm * num_sms // max(num_ctas, 1))))
    tiles_per_split = -(-max_tiles // num_splits)
    return -(-max_tiles // tiles_per_split), tiles_per_split * KV_TILE


def _check_vector_loads(name: str, t: torch.Tensor) -> None:
    """The kernel reads `t` in 16-byte (8-byte for codes) pieces: aligned base, strides of 8 elements."""
    require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    require(t.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned")
    require(
        all(st % 8 == 0 for st in t.stride()[:-1]),
        f"{name} strides must be multiples of 8 elements, got {t.stride()}",
    )


def _check_field(
    name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    require(t is not None, f"{name} is required")
    assert t is not None
    require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    require(tuple(t.shape) == shape, f"{name} must be {shape}, got {tuple(t.shape)}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")
    require(t.stride(-1) == 1 or t.shape[-1] == 1, f"{name} must be contiguous in its last dim")
    return t


def check_kv_operands(
    kv_format: str,
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
    k_open: torch.Tensor | None = None,
    k_open_slot: torch.Tensor | None = None,
) -> None:
    """The pool-format operands of `paged_attention` (shapes as in PagedKV); ValueError naming the
    problem. Caches and metadata are checked by kvserve.kernels.checks.check_paged_args."""
    require(kv_format in KV_FORMATS, f"kv_format must be one of {tuple(KV_FORMATS)}, got {kv_format!r}")
    extras = {"k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale, "v_zero": v_zero}
    extras |= {"k_open": k_open, "k_open_slot": k_open_slot}
    used = {"dense": (), "fp8_e4m3": ("k_scale", "v_scale"), "int8": tuple(extras)}[kv_format]
    unused = [name for name, t in extras.items() if t is not None and name not in used]
    require(not unused, f"{', '.join(unused)} given, but kv_format {kv_format!r} does not use them")
    _check_vector_loads("k_cache", k_cache)
    _check_vector_loads("v_cache", v_cache)
    if kv_format == "dense":
        return
    if kv_format == "fp8_e4m3":
        check_scales(k_scale, v_scale, k_cache)
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    require(
        head_dim % KIVI_V_GROUP == 0,
        f"int8 pools need head_dim a multiple of {KIVI_V_GROUP} (V scale groups), got {head_dim}",
    )
    device, half = query.device, torch.float16
    k_shape = (num_blocks, num_kv_heads, head_dim)
    v_shape = (num_blocks, block_size, num_kv_heads, head_dim // KIVI_V_GROUP)
    ks = _check_field("k_scale", k_scale, k_shape, half, device)
    kz = _check_field("k_zero", k_zero, k_shape, half, device)
    vs = _check_field("v_scale", v_scale, v_shape, half, device)
    vz = _check_field("v_zero", v_zero, v_shape, half, device)
    require(ks.stride() == kz.stride(), f"k_scale and k_zero strides differ: {ks.stride()}, {kz.stride()}")
    require(vs.stride() == vz.stride(), f"v_scale and v_zero strides differ: {vs.stride()}, {vz.stride()}")
    _check_vector_loads("k_scale", ks)
    _check_vector_loads("k_zero", kz)
    require(k_open is not None, "k_open is required")
    assert k_open is not None
    require(
        k_open.dim() == 4 and tuple(k_open.shape[1:]) == (block_size, num_kv_heads, head_dim),
        f"k_open must be [capacity, {block_size}, {num_kv_heads}, {head_dim}], got {tuple(k_open.shape)}",
    )
    require(
        k_open.dtype == query.dtype,
        f"k_open (open blocks' K) must have the query dtype {query.dtype}, got {k_open.dtype}",
    )
    require(k_open.device == device, f"k_open is on {k_open.device}, expected {device}")
    _check_vector_loads("k_open", k_open)
    slots = _check_field("k_open_slot", k_open_slot, (num_blocks,), torch.int32, device)
    require(slots.is_contiguous(), "k_open_slot must be contiguous")


def paged_attention(
    query: torch.Tensor,  # [T, H, D] fp16 / bf16
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]: query dtype, or uint8 codes (8-bit formats)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    kv_format: str = "dense",
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
    k_open: torch.Tensor | None = None,
    k_open_slot: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal (bottom-right) attention of a packed varlen batch over the paged pool, on the current stream.

    kv_format "dense" reads k_cache / v_cache as values; "fp8_e4m3" and "int8" read the codes and the
    operands listed in kvserve.kernels.paged_kv.PagedKV (`paged_kv(kv, query.dtype)` collects them).
    """
    require(kv_format in KV_FORMATS, f"kv_format must be one of {tuple(KV_FORMATS)}, got {kv_format!r}")
    shape = check_paged_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        dtypes=COMPUTE_DTYPES,
        kv_dtype=None if kv_format == "dense" else torch.uint8,
    )
    check_kv_operands(
        kv_format, query, k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, k_open, k_open_slot
    )
    if query.device.type != "cuda":
        raise ValueError(f"the CUDA extension needs CUDA tensors, got {query.device}")
    group = shape.num_heads // shape.num_kv_heads
    decode_config = max_query_len * group <= 16  # one warp of 16 packed rows covers every sequence
    rows_per_cta = 16 if decode_config else 64
    num_ctas = -(-max_query_len * group // rows_per_cta) * shape.num_seqs * shape.num_kv_heads
    num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    # one-warp decode CTAs: aim at 8 per SM, the warps two 4-warp prefill CTAs put there (registers
    # allow 9 resident, shared memory 6; Nsight Compute, H200 run 3: 6 % achieved occupancy at 2 per SM)
    ctas_per_sm = 8 if decode_config else 2
    num_splits, tokens_per_split = plan_splits(num_ctas, max_seq_len, num_sms, ctas_per_sm)
    return load().paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        max_query_len, scale, num_splits, tokens_per_split, decode_config,
        KV_FORMATS[kv_format], k_scale, k_zero, v_scale, v_zero, k_open, k_open_slot,
    )  # fmt: skip
