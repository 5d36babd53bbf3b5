"""NestedFP Triton linear on a GPU (kvserve/kernels/triton/nested_linear.py) against torch's fp16 matmul,
on Llama-3.1-8B's projection shapes. Targets (docs/gpu.md): FP16 mode >= 0.9x torch fp16; FP8 mode
>= 1.4x FP16 mode at 256 rows or more. A few launch shapes are tried per case and the fastest kept
(named in the table: block_m, block_n, block_k, warps, stages, swap, split_k). torch._scaled_mm with fp8 operands, where the GPU has fp8 tensor cores, is
shown as the ceiling an FP8 mode computing in fp8 could reach (the kernel's FP8 mode converts the
E4M3 bytes to fp16 and multiplies in fp16: it saves bytes, not arithmetic).

    python scripts/gpu/bench_nested.py [--rows 1 16 256 1024 4096] [--json nested.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvserve.kernels.triton.nested_linear import nested_linear
from kvserve.quant.nestedfp import NestedWeight

SHAPES = {
    "qkv 4096->6144": (6144, 4096),
    "gate|up 4096->28672": (28672, 4096),
    "down 14336->4096": (4096, 14336),
}
# (block_m, block_n, block_k, num_warps, num_stages, swap, split_k): nested_linear's launch options
LAUNCHES = [
    (16, 64, 64, 4, 3, False, 1),
    (16, 128, 128, 4, 4, False, 1),
    (64, 128, 64, 4, 4, False, 1),
    (128, 128, 64, 8, 3, False, 1),
    (128, 256, 64, 8, 3, False, 1),
    (128, 128, 64, 8, 4, False, 1),
    # the weight tile as the dot's first operand (wgmma may read it from registers)
    (16, 128, 128, 4, 4, True, 1),
    (64, 128, 64, 4, 4, True, 1),
    (128, 128, 64, 8, 3, True, 1),
    (256, 128, 64, 8, 3, True, 1),
    # few rows: the inputs split so that the weight is read by more programs than N / block_n
    (16, 64, 128, 4, 4, False, 4),
    (16, 128, 128, 4, 4, True, 4),
    (16, 64, 64, 4, 3, False, 8),
]


def median_ms(fn, reps: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median")


def best_launch(x, w: NestedWeight, fp16: bool, reps: int) -> tuple[float, tuple]:
    hi, lo, scale = w.hi, w.lo, w.scale
    times = []
    base = None
    for launch in LAUNCHES:
        if launch[0] > max(16, x.shape[0] * 2):  # a block far taller than the rows only computes padding
            continue
        if launch[6] > 1 and x.shape[0] > 64:  # split inputs only where few rows leave programs idle
            continue
        fn = lambda launch=launch: nested_linear(x, hi, lo, scale, fp16, *launch)  # noqa: E731
        out = fn().float()
        if base is None:
            base = out
        err = float((out - base).abs().max() / base.abs().max().clamp_min(1e-30))
        if not err < 1e-2:  # every launch computes the same product up to summation order
            print(f"  WRONG: launch {launch} differs from {LAUNCHES[0]} by {err:.2e} of the largest output")
            continue
        times.append((median_ms(fn, reps), launch))
    return min(times)


def scaled_mm_ms(x: torch.Tensor, w: torch.Tensor, reps: int) -> float | None:
    """torch._scaled_mm on fp8 e4m3 x and w (per-tensor scales), or None where it cannot run."""
    try:
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn)  # [N, K] row-major: .t() is the column-major operand it wants
        one = torch.ones((), device=x.device)
        fn = lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float16)  # noqa: E731
        fn()
        return median_ms(fn, 50)
    except (RuntimeError, TypeError, AttributeError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=50, help="milliseconds of timed repetitions (do_bench)")
    ap.add_argument(
        "--check-args",
        action="store_true",
        help="parse the arguments and import the GPU path, then stop (scripts/gpu/run.sh's CPU dry run)",
    )
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.check_args:
        return print("arguments ok")  # nested_linear (triton) is imported at the top
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'shape':<22} {'rows':>5} {'torch fp16':>10} {'FP16 mode':>10} {'x torch':>7} {'FP8 mode':>9} "
        f"{'x FP16m':>7} {'fp8 mm':>8}  launches (FP16, FP8)"
    )
    out = []
    for name, (n, k) in SHAPES.items():
        w16 = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).half()
        nested = NestedWeight.from_float(w16.float())  # torch ops: converted on the GPU
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", generator=gen).half()
            ref = median_ms(lambda: x @ w16.t(), args.reps)  # noqa: B023
            fp16_ms, fp16_launch = best_launch(x, nested, True, args.reps)
            fp8_ms, fp8_launch = best_launch(x, nested, False, args.reps)
            mm8 = scaled_mm_ms(x, w16, args.reps) if rows >= 16 else None
            row = dict(shape=name, rows=rows, torch_fp16_ms=ref, fp16_mode_ms=fp16_ms, fp8_mode_ms=fp8_ms,
                       fp16_vs_torch=ref / fp16_ms, fp8_vs_fp16_mode=fp16_ms / fp8_ms, scaled_mm_fp8_ms=mm8,
                       fp16_launch=fp16_launch, fp8_launch=fp8_launch)  # fmt: skip
            out.append(row)
            print(
                f"{name:<22} {rows:>5} {ref:>10.4f} {fp16_ms:>10.4f} {ref / fp16_ms:>7.2f} {fp8_ms:>9.4f} "
                f"{fp16_ms / fp8_ms:>7.2f} {mm8 if mm8 is not None else float('nan'):>8.4f}  {fp16_launch} {fp8_launch}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
