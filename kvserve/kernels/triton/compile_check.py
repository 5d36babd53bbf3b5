"""Compile every Triton kernel for a CUDA target with no GPU present (CI catches compile errors).

    python -m kvserve.kernels.triton.compile_check [--arch 90] [--quick]

Must run without TRITON_INTERPRET=1 (the interpreter replaces @triton.jit functions at import).
Prints one line per (kernel, variant) with the shared memory each needs and, where triton bundles
cuobjdump, its registers per thread and stack (spill) bytes; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget

from kvserve.kernels.triton.nested_linear import nested_linear_kernel
from kvserve.kernels.triton.paged_decode import (
    FP8_BLOCK_N,
    INT8_BLOCK_N,
    INT8_NUM_WARPS,
    merge_splits_kernel,
    paged_decode_split_kernel,
)
from kvserve.kernels.triton.paged_prefill import paged_prefill_kernel

TRITON_TYPES = {"fp16": "*fp16", "bf16": "*bf16"}
INT32_POINTERS = {"block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "k_open_slot_ptr"}
FP32_POINTERS = {"o_part_ptr", "lse_part_ptr", "scale_ptr"}
U8_POINTERS = {"hi_ptr", "lo_ptr"}  # NestedFP planes
CODE_POINTERS = {"k_cache_ptr", "v_cache_ptr"}  # uint8 with FP8_KV / INT8_KV / MXFP4_KV
SCALE_POINTERS = {"k_scale_ptr", "v_scale_ptr", "k_zero_ptr", "v_zero_ptr"}  # fp32 (fp8), fp16 (int8)
E8M0_POINTERS = {"k_scale_ptr", "v_scale_ptr"}  # uint8 exponents with MXFP4_KV
FP32_SCALARS = {"qk_scale"}
OPTIONS = {"num_warps"}  # compile options, not constexprs


def signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton signature for `kernel`: data pointers in `dtype`, metadata int32, scalars i32/fp32."""
    quantized = bool(constexprs.get("FP8_KV") or constexprs.get("INT8_KV") or constexprs.get("MXFP4_KV"))
    # FP8 prefill scales are fp32 (SCALE_POINTERS); a dense prefill's are never read: any type does
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT32_POINTERS:
            sig[name] = "*i32"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in U8_POINTERS or (name in E8M0_POINTERS and constexprs.get("MXFP4_KV")):
            sig[name] = "*u8"
        elif name in SCALE_POINTERS:
            sig[name] = "*fp16" if constexprs.get("INT8_KV") else "*fp32"
        elif name in CODE_POINTERS and quantized:
            sig[name] = "*u8"
        elif name.endswith("_ptr"):
            sig[name] = TRITON_TYPES[dtype]
        elif name in FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants(quick: bool, arch: int = 90) -> list[tuple[str, object, str, dict]]:
    """Every (name, kernel, dtype, constexprs and options) to compile; the hardware fp8 conversion
    (NATIVE_FP8) only for sm_89 and later, as the launchers choose it (paged_decode.native_fp8)."""
    dtypes = ["bf16"] if quick else ["fp16", "bf16"]
    head_dims = [128] if quick else [64, 128]
    fp8_modes = [("fp8kv", False), ("fp8kv-native", True)] if arch >= 89 else [("fp8kv", False)]
    out = []
    for dtype in dtypes:
        for d in head_dims:
            common = dict(HEAD_DIM=d, BLOCK_SIZE=16, DOT_FP32=False)
            prefill = dict(
                common, GROUP=4, BLOCK_M=64, BLOCK_N=64, FP8_KV=False, FP8_CONVERT=0, WINDOWED=False
            )
            out.append(("prefill", paged_prefill_kernel, dtype, prefill))
            out.append(("prefill-window", paged_prefill_kernel, dtype, dict(prefill, WINDOWED=True)))
            for label, convert in [*((label, int(native)) for label, native in fp8_modes), ("fp8kv-fp32", 2)]:
                out.append(
                    (
                        f"prefill-{label}",
                        paged_prefill_kernel,
                        dtype,
                        dict(prefill, FP8_KV=True, FP8_CONVERT=convert),
                    )
                )
            decode = dict(common, GROUP=8, GROUP_PAD=16, BLOCK_N=64)
            for label, fp8, int8, mxfp4, native in (
                ("decode", False, False, False, False),
                *((f"decode-{label}", True, False, False, native) for label, native in fp8_modes),
                ("decode-int8kv", False, True, False, False),
                ("decode-mxfp4kv", False, False, True, False),
            ):
                flags = dict(
                    FP8_KV=fp8, INT8_KV=int8, MXFP4_KV=mxfp4, NATIVE_FP8=native, V_GROUP=64, TILE_BLOCKS=4
                )
                if fp8:  # the launcher's fp8 default
                    flags.update(BLOCK_N=FP8_BLOCK_N, TILE_BLOCKS=FP8_BLOCK_N // 16)
                if int8:  # the launcher's int8 defaults
                    flags.update(
                        BLOCK_N=INT8_BLOCK_N, TILE_BLOCKS=INT8_BLOCK_N // 16, num_warps=INT8_NUM_WARPS
                    )
                out.append((label, paged_decode_split_kernel, dtype, dict(decode, **flags)))
            out.append(("merge", merge_splits_kernel, dtype, dict(HEAD_DIM=d, SPLITS_PAD=16)))
        for fp16 in (False, True):
            tiles = dict(FP16=fp16, X_FP32=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP=False, SPLIT_K=1)
            out.append((f"nested-{'fp16' if fp16 else 'fp8'}", nested_linear_kernel, dtype, tiles))
            swapped = dict(tiles, BLOCK_M=128, BLOCK_N=128, SWAP=True, num_warps=8)
            out.append((f"nested-{'fp16' if fp16 else 'fp8'}-swap", nested_linear_kernel, dtype, swapped))
    return out


def resource_usage(compiled) -> str:
    """'regs=N stack=NB' from `cuobjdump --dump-resource-usage` of the cubin, or '' without one."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = compiled.asm.get("cubin")
    if not os.path.exists(tool) or not cubin:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", proc.stdout)
    return f"  regs={found[1]} stack={found[2]}B" if found else ""


def compile_all(arch: int, quick: bool) -> list[str]:
    """Compiles every variant for sm_`arch`; returns the failures (empty when all compiled)."""
    failures = []
    target = GPUTarget("cuda", arch, 32)
    for name, kernel, dtype, params in variants(quick, arch):
        label = f"{name} {dtype} " + " ".join(f"{k}={v}" for k, v in params.items() if k != "DOT_FP32")
        constexprs = {k: v for k, v in params.items() if k not in OPTIONS}
        options = {k: v for k, v in params.items() if k in OPTIONS}
        t0 = time.perf_counter()
        try:
            src = triton.compiler.ASTSource(
                fn=kernel, signature=signature(kernel, dtype, constexprs), constexprs=constexprs
            )
            compiled = triton.compile(src, target=target, options=options)
        except Exception as exc:  # noqa: BLE001 - collect every failure
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
            print(f"FAIL sm_{arch} {label}: {exc}", flush=True)
            continue
        shared = compiled.metadata.shared
        usage = resource_usage(compiled)
        print(f"ok   sm_{arch} {label}  shared={shared}B{usage}  {time.perf_counter() - t0:.1f}s", flush=True)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    ap.add_argument("--quick", action="store_true", help="one dtype and head_dim only")
    args = ap.parse_args()
    failures = [f for arch in args.arch for f in compile_all(arch, args.quick)]
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
