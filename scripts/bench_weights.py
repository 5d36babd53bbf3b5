"""NestedFP linear kernels against the fp32 and bf16 ones, on one decode step's projections of a model:
each layer's q|k|v, o, gate|up and down, and the LM head, with rows = 1 (single-stream decode) and
rows = 8 (8-way batched decode). Every kernel gets the same inputs in the same run; the order of the
kernels rotates each repeat. Writes docs/weights.md between the nestedfp-gemv markers.

This is the projections alone, not a served token: the engine does not load NestedFP weights yet.

    python scripts/bench_weights.py [--model smollm2-135m] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from doc_section import fill
from machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nestedfp_report import linear_weights  # noqa: E402

from kvserve.kernels import cpu_ext  # noqa: E402
from kvserve.quant.nestedfp import NestedWeight  # noqa: E402

KERNELS = ("fp32", "bf16", "nested fp16", "nested fp8", "nested fp8, unpacked per call")
ROWS = (1, 8, 128)


def step_weights(model: str) -> list[torch.Tensor]:
    """One decode step's weights, fused as the engine fuses them (q|k|v, gate|up), plus the LM head."""
    from safetensors.torch import load_file

    from kvserve.models.loader import resolve_model_path

    w = linear_weights(model)
    out: list[torch.Tensor] = []
    layers = sorted({int(k.split(".")[2]) for k in w})
    for i in layers:
        p = f"model.layers.{i}."
        out.append(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))  # type: ignore[misc]
        out.append(w[p + "self_attn.o_proj.weight"])  # type: ignore[arg-type]
        out.append(torch.cat([w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]))  # type: ignore[misc]
        out.append(w[p + "mlp.down_proj.weight"])  # type: ignore[arg-type]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(resolve_model_path(model).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out.append(tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]))  # tied in SmolLM2
    return [t.float().contiguous() for t in out]


def kernels(ext, weights: list[torch.Tensor]) -> dict[str, tuple[Callable[[int], None], int]]:
    """name -> (run one step at `rows`, weight bytes it reads)."""
    fp32 = [(ext.pack_linear_weight(w), w.shape[0]) for w in weights]
    bf16 = [(ext.pack_linear_weight_bf16(w.bfloat16()), w.shape[0]) for w in weights]
    nested = [NestedWeight.from_float(w) for w in weights]
    planes = [(ext.pack_nested_weight(n.hi, n.lo), n.scale, n.shape[0]) for n in nested]
    params = sum(w.numel() for w in weights)
    inputs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def x(rows: int, in_f: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (rows, in_f, dtype)
        if key not in inputs:
            gen = torch.Generator().manual_seed(rows)
            inputs[key] = torch.randn(rows, in_f, generator=gen).to(dtype)
        return inputs[key]

    def run_fp32(rows: int) -> None:
        for p, out in fp32:
            ext.row_linear(x(rows, p.shape[1]), p, None, out)

    def run_bf16(rows: int) -> None:
        for p, out in bf16:
            ext.row_linear_bf16(x(rows, 2 * p.shape[1], torch.bfloat16), p, None, out)

    def run_nested(fp16: bool) -> Callable[[int], None]:
        def run(rows: int) -> None:
            for p, scale, out in planes:
                ext.nested_linear(x(rows, p.shape[2]), p, scale, None, out, fp16)

        return run

    def run_unpacked(rows: int) -> None:  # dequantize each weight once, then the fp32 kernel
        for p, scale, out in planes:
            ext.row_linear(x(rows, p.shape[2]), ext.unpack_nested_weight(p, scale, out, False), None, out)

    return {
        "fp32": (run_fp32, 4 * params),
        "bf16": (run_bf16, 2 * params),
        "nested fp16": (run_nested(True), 2 * params),
        "nested fp8": (run_nested(False), params),
        "nested fp8, unpacked per call": (run_unpacked, params),
    }


def measure(runs: dict[str, tuple[Callable[[int], None], int]], rows: int, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for name in names:  # warm-up: first-touch of the packed weights, thread pool start
        runs[name][0](rows)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            runs[name][0](rows)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def render(model: str, threads: int, params: int, runs: dict, results: dict[int, dict[str, float]]) -> str:
    head = " | ".join(f"ms, {r} row{'s' if r > 1 else ''} | x fp32" for r in ROWS)
    lines = [
        f"Measured by `python scripts/bench_weights.py --threads {threads}` on {describe(threads)}; "
        f"model {model}: one decode step's projections (30 layers' q|k|v, o, gate|up, down and the "
        f"tied LM head), {params / 1e6:.1f} M weights, at 1, 8 and 128 rows. Median of the repeats; "
        "kernels interleaved.",
        "",
        f"| kernel | weight bytes | GB/s, 1 row | {head} |",
        "|---|---:|---:|" + "---:|---:|" * len(ROWS),
    ]
    for name in KERNELS:
        nbytes = runs[name][1]
        cells = " | ".join(
            f"{1000 * results[r][name]:.2f} | {results[r]['fp32'] / results[r][name]:.2f}x" for r in ROWS
        )
        lines.append(f"| {name} | {nbytes / 1e6:.0f} MB | {nbytes / results[1][name] / 1e9:.1f} | {cells} |")
    fp8_vs_16 = results[8]["nested fp16"] / results[8]["nested fp8"]
    lines += [
        "",
        f'8 rows, nested fp8 against nested fp16: {fp8_vs_16:.2f}x. "unpacked per call" converts each '
        "weight once into row_linear's fp32 layout and runs the fp32 kernel (the prefill option).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "weights.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    weights = step_weights(args.model)
    runs = kernels(ext, weights)
    results = {rows: measure(runs, rows, args.repeats) for rows in ROWS}
    text = render(args.model, args.threads, sum(w.numel() for w in weights), runs, results)
    print(text)
    fill(args.doc, "nestedfp-gemv", text)


if __name__ == "__main__":
    main()
