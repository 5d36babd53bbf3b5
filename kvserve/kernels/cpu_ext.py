"""The kvserve CPU extension (csrc/cpu/): paged attention over the pool read in place, fp32 and bf16
linear, and the fused forward's RMSNorm and rotary embedding (layer_ops.cpp).

JIT-built once with torch.utils.cpp_extension.load (g++ and ninja, about a minute on two cores),
then cached by torch under TORCH_EXTENSIONS_DIR; a source change rebuilds it. `attention(...)` picks
the entry point for the pool's format (kvserve/kernels/paged_kv.py): dense (any float dtype),
fp8_e4m3, int8 KIVI. Both kernels are batch invariant: a row's result does not depend on the other
rows of the call, the thread count or the tiling (csrc/cpu/paged_attention_cpu.cpp). Where the build
cannot run (no compiler), `load_or_none()` returns None once, with the reason logged, and the
cpu_paged backend keeps to its torch-ops path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from kvserve.kernels.cpu_features import has_amx_bf16, has_avx512_bf16, torch_capability
from kvserve.kernels.paged_kv import PagedKV, paged_kv
from kvserve.kvcache.kv_storage import LayerKV

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = [
    "cpu/paged_attention_cpu.cpp",
    "cpu/linear_cpu.cpp",
    "cpu/nested_linear.cpp",
    "cpu/linear_codes.cpp",
    "cpu/linear_qcodes.cpp",
    "cpu/linear_qcodes_pack.cpp",
    "cpu/layer_ops.cpp",
]
HEADERS = [
    "cpu/vec.h",
    "cpu/kv_readers.h",
    "cpu/attention_math.h",
    "cpu/paged_attention.h",
    "cpu/parallel.h",
    "cpu/linear_tiles.h",
    "cpu/linear_widened.h",
    "cpu/linear_qcodes.h",
    "cpu/linear_amx.h",
    "cpu/amx.h",
    "cpu/attention_amx.h",
]
# -ffp-contract=off: a multiply-add is fused only where the source says so (csrc/cpu/vec.h: fmadd), so
# the arithmetic of every output element is fixed by the source, not by how the compiler schedules it.
FLAGS = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"]
# Vector ISA flags per torch's CPU capability (what ATen itself dispatches to on this machine). The
# capability is part of the extension's name, so a build cache shared by different CPUs never hands
# an AVX-512 build to a machine without it (which -march=native would risk).
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "AVX512": AVX512_FLAGS,
    "AVX512_BF16": [*AVX512_FLAGS, "-mavx512bf16"],
    "AVX512_BF16_AMX": [*AVX512_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_capability() -> str:
    """torch's capability ('AVX512', 'AVX2', ...; generic code for the others), with '_BF16' where the
    CPU also has AVX-512 BF16 (native bf16 dot products for row_linear_bf16) and '_AMX' where it also
    has AMX-BF16 tiles (row_linear_bf16's AMX path, csrc/cpu/linear_amx.h)."""
    if not has_avx512_bf16():
        return torch_capability()
    return "AVX512_BF16" + ("_AMX" if has_amx_bf16() else "")


def unavailable_reason() -> str:
    """'' when the extension can be built here, else why not."""
    if os.environ.get("KVSERVE_CPU_EXT") == "0":
        return "disabled by KVSERVE_CPU_EXT=0"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ / $CXX) on PATH"
    if shutil.which("ninja") is None and not _venv_ninja():
        return "ninja is not installed (pip install ninja)"
    if not all((CSRC / s).exists() for s in SOURCES + HEADERS):
        return f"C++ sources missing under {CSRC}"
    return ""


def _build_directory(name: str) -> Path:
    """One build directory per source tree and header contents: torch writes absolute source paths into
    build.ninja, so two checkouts sharing a directory rebuild over each other (minutes each) and wait on
    each other's lock; and torch rebuilds when a source file changes but not when only a header does,
    so the headers' bytes are part of the directory's name."""
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256(str(CSRC).encode())
    for header in HEADERS:
        digest.update((CSRC / header).read_bytes())
    tree = digest.hexdigest()[:10]
    path = Path(_get_build_directory(name, verbose=False)).with_name(f"{name}-{tree}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _venv_ninja() -> bool:
    return (Path(sys.executable).parent / "ninja").exists()


@functools.cache
def load() -> ModuleType:
    """Builds (or loads the cached build of) the extension; RuntimeError if it cannot be built here."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"kvserve CPU extension unavailable: {reason}")
    from torch.utils.cpp_extension import load as load_extension

    # torch runs `ninja` from PATH: make the venv's ninja visible when the venv is not activated
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    capability = cpu_capability()
    name = f"kvserve_cpu_ext_{capability.lower()}"
    t0 = time.perf_counter()
    module = load_extension(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=FLAGS + ISA_FLAGS.get(capability, []),
        extra_ldflags=["-fopenmp"],
        build_directory=str(_build_directory(name)),
        verbose=os.environ.get("KVSERVE_VERBOSE_BUILD") == "1",
    )
    elapsed = time.perf_counter() - t0
    if elapsed > 5:
        log.info("built the kvserve CPU attention extension in %.0f s (cached from now on)", elapsed)
    if os.environ.get("KVSERVE_CPU_AMX") == "0":
        module.set_amx(False)  # the AVX-512 BF16 sums: the bits of a machine without AMX
    return module


def linear_path(module: ModuleType, in_features: int) -> str:
    """How row_linear_bf16 computes a layer of `in_features` inputs here: 'AMX tiles' or 'AVX-512'
    style lanes (the build's vector ISA); the two sum in different orders, so their bits differ."""
    return "AMX tiles" if module.linear_amx(in_features) else f"{cpu_capability().removesuffix('_AMX')} lanes"


@functools.cache
def load_or_none() -> ModuleType | None:
    """The extension, or None (reason logged once) where it cannot be built."""
    try:
        log.info("loading the kvserve CPU attention extension (its first build takes about a minute)")
        return load()
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch-ops path
        log.warning("kvserve CPU attention extension unavailable, using torch ops: %s", str(exc)[-500:])
        return None


HEAD_DIMS = (16, 32, 64, 128, 256)  # run_for_head_dim in csrc/cpu/paged_attention_cpu.cpp
KV_FORMATS = ("dense", "fp8_e4m3", "int8")  # PagedKV.kv_format values with an entry point (attention)


def readable_pool(kv: LayerKV) -> PagedKV | None:
    """`kv` as the extension reads it in place (any dense or stored-as-is float pool, e.g. bf16 KV under
    fp32 compute; fp8_e4m3; int8 KIVI), or None for other formats (mxfp4 among them) and head dims."""
    pool = paged_kv(kv) if kv.head_dim in HEAD_DIMS else None
    return pool if pool is not None and pool.kv_format in KV_FORMATS else None


NO_POSITIONS = torch.empty(0, dtype=torch.int32)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int32; the step's metadata already is, and this runs 30 times a step."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def attention(
    module: ModuleType,
    query: torch.Tensor,  # [num_rows, H, D] contiguous
    pool: PagedKV,  # readable_pool(kv), or a dense PagedKV over a dense copy
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    positions: torch.Tensor | None = None,  # [num_rows] int32; None: each sequence's rows end its KV
    window: int | None = None,  # a sliding-window layer's window
) -> torch.Tensor:  # [num_rows, H, D]
    """Causal attention of every row over its sequence's blocks, read in place in the pool's format:
    a row at position p sees KV positions [0, p], or with a window (p - window, p]."""
    args = (
        _int32(block_tables),
        _int32(seq_lens),
        _int32(query_start_loc),
        NO_POSITIONS if positions is None else _int32(positions),
        float(scale),
        int(window or 0),
    )
    query = query if query.is_contiguous() else query.contiguous()
    if pool.kv_format == "dense":
        return module.paged_attention_dense(query, pool.k_cache, pool.v_cache, *args)
    if pool.kv_format == "fp8_e4m3":
        return module.paged_attention_fp8(
            query, pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale, *args
        )
    return module.paged_attention_int8(
        query, pool.k_cache, pool.k_scale, pool.k_zero, pool.k_open, pool.k_open_slot,
        pool.v_cache, pool.v_scale, pool.v_zero, *args,
    )  # fmt: skip
