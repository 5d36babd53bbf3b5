"""The kvserve CUDA extension (csrc/): JIT-built once with torch.utils.cpp_extension.load, then cached.

`load()` builds on first use (about a minute; torch caches the build under TORCH_EXTENSIONS_DIR and
rebuilds only when a source changes). `paged_attention(...)` checks its arguments, plans split-KV and
launches on the current stream.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from kvserve.kernels.checks import check_paged_args

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ["bindings.cpp", "attention/paged_attention.cu", "attention/merge_splits.cu"]
KV_TILE = 64  # kKvTile in csrc/attention/paged_attention.h


def unavailable_reason() -> str:
    """'' when the extension can be built and run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"needs compute capability >= 8.0 (mma.sync bf16), got {torch.cuda.get_device_capability()}"
    if not all((CSRC / s).exists() for s in SOURCES):
        return f"CUDA sources missing under {CSRC}"
    return ""


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


def plan_splits(num_ctas: int, max_seq_len: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, tokens_per_split): split the KV until about two CTAs per SM, never below one tile."""
    max_tiles = max(1, -(-max_seq_len // KV_TILE))
    num_splits = min(max_tiles, max(1, -(-2 * num_sms // max(num_ctas, 1))))
    tiles_per_split = -(-max_tiles // num_splits)
    return -(-max_tiles // tiles_per_split), tiles_per_split * KV_TILE


def paged_attention(
    query: torch.Tensor,  # [T, H, D] fp16 / bf16
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal (bottom-right) attention of a packed varlen batch over the paged pool, on the current stream."""
    shape = check_paged_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        dtypes=(torch.float16, torch.bfloat16),
    )
    if query.device.type != "cuda":
        raise ValueError(f"the CUDA extension needs CUDA tensors, got {query.device}")
    group = shape.num_heads // shape.num_kv_heads
    decode_config = max_query_len * group <= 16  # one warp of 16 packed rows covers every sequence
    rows_per_cta = 16 if decode_config else 64
    num_ctas = -(-max_query_len * group // rows_per_cta) * shape.num_seqs * shape.num_kv_heads
    num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    num_splits, tokens_per_split = plan_splits(num_ctas, max_seq_len, num_sms)
    return load().paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        max_query_len, scale, num_splits, tokens_per_split, decode_config,
    )  # fmt: skip
