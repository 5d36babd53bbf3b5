"""The bf16 linear kernels side by side: row_linear_bf16 on AMX tiles (where the CPU has them), the same
kernel on its AVX-512 lanes (`set_amx(False)`), and torch's bf16 linear (oneDNN), over the
projections of the default and the Qwen model at decode and prefill row counts. Median of repeated
calls, GFLOP/s; the ratios are within one run.

    python scripts/bench_linear.py [--rows 1 8 256 1800] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from machine import describe, machine

from kvserve.kernels import cpu_ext

# (name, in_features, out_features)
SHAPES = [
    ("smollm2 gate+up", 576, 3072),
    ("qwen2.5-0.5b qkv", 896, 1152),
    ("qwen2.5-0.5b gate+up", 896, 9728),
    ("qwen2.5-0.5b down", 4864, 896),
]


def seconds(fn, budget: float = 0.6) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_paths(ext, x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, amx: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds of torch's linear, our AVX-512 lanes and (where it runs) our AMX tiles."""
    out = w.shape[0]
    t = {"torch": seconds(lambda: F.linear(x, w))}
    before = ext.set_amx(False)
    t["lanes"] = seconds(lambda: ext.row_linear_bf16(x, packed, None, out))
    ext.set_amx(before)
    if amx:
        t["amx"] = seconds(lambda: ext.row_linear_bf16(x, packed, None, out))
    return t


def cell(s: float, flops: int) -> str:
    return f"{s * 1e3:.3f} ms ({flops / s / 1e9:.0f} GF/s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256, 1800])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    amx = ext.linear_amx(SHAPES[0][1])
    rows_out = []
    print(f"# bench_linear: {describe()}")
    print(
        "| projection | rows | "
        + ("AMX tiles | " if amx else "")
        + "AVX-512 lanes | torch bf16 | torch time / ours |"
    )
    print("|---|---|" + ("---|" if amx else "") + "---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, fin, fout in SHAPES:
        w = (torch.randn(fout, fin, generator=gen) * 0.05).bfloat16()
        packed = ext.pack_linear_weight_bf16(w)
        for rows in args.rows:
            x = torch.randn(rows, fin, generator=gen).bfloat16()
            t = time_paths(ext, x, w, packed, amx)
            ours = t["amx"] if amx else t["lanes"]
            flops = 2 * rows * fin * fout
            cells = [cell(t[k], flops) for k in ("amx", "lanes", "torch") if k in t]
            print(f"| {name} | {rows} | " + " | ".join(cells) + f" | {t['torch'] / ours:.2f} |")
            rows_out.append({"projection": name, "in": fin, "out": fout, "rows": rows, "seconds": t})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine(), "describe": describe(), "amx": amx, "results": rows_out}, f, indent=1
            )


if __name__ == "__main__":
    main()
