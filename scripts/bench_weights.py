"""NestedFP weights against fp32 and bf16 ones, written to docs/weights.md. Three parts:

- kernels (section nestedfp-gemv): one decode step's projections of a model (each layer's q|k|v, o,
  gate|up and down, and the LM head) at 1, 8 and 128 rows, every kernel on the same inputs, the order
  rotating each repeat;
- engine (nestedfp-engine; scripts/harness/weights_engine.py, each format measured by
  scripts/weights_engine.py in its own process): SmolLM2 served by the engine in each weight format:
  weight bytes, single-stream and 8-way decode, perplexity;
- auto (nestedfp-auto; scripts/harness/weights_auto.py): --weight-precision auto under a load ramp
  against fp16 and fp8 alone.

    python scripts/bench_weights.py [--part kernels|engine|auto|all] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.checkpoint import checkpoint, linear_weights  # noqa: E402
from harness.docs import fill  # noqa: E402
from harness.machine import describe  # noqa: E402

from kvserve.kernels import cpu_ext  # noqa: E402
from kvserve.quant.nestedfp import NestedWeight  # noqa: E402

KERNELS = ("fp32", "bf16", "nested fp16", "nested fp8", "nested fp8, unpacked per call")
ROWS = (1, 8, 128)


def step_weights(model: str) -> list[torch.Tensor]:
    """One decode step's weights, fused as the engine fuses them (q|k|v, gate|up), plus the LM head."""
    w = linear_weights(model)
    out: list[torch.Tensor] = []
    layers = sorted({int(k.split(".")[2]) for k in w})
    for i in layers:
        p = f"model.layers.{i}."
        out.append(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))  # type: ignore[misc]
        out.append(w[p + "self_attn.o_proj.weight"])  # type: ignore[arg-type]
        out.append(torch.cat([w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]))  # type: ignore[misc]
        out.append(w[p + "mlp.down_proj.weight"])  # type: ignore[arg-type]
    tensors = checkpoint(model)
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
    ap.add_argument("--part", choices=["kernels", "engine", "auto", "peers", "all"], default="all")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=2, help="engine part: rounds over the formats")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "weights.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine_json = args.doc.parent / "data" / "weights_engine.json"
    if args.part in ("kernels", "all"):
        kernel_part(args)
    if args.part in ("engine", "all"):
        from harness import weights_engine

        results = weights_engine.run_all(args.rounds, repeats=3)
        engine_json.parent.mkdir(parents=True, exist_ok=True)
        engine_json.write_text(json.dumps(results, indent=1) + "\n")
        text = weights_engine.render(results, describe(args.threads), args.rounds, 3)
        print(text)
        fill(args.doc, "nestedfp-engine", text)
    if args.part in ("peers", "all"):
        text = peers_part(args)
        print(text)
        fill(args.doc, "nestedfp-peers", text)
    if args.part in ("auto", "all"):
        from harness import weights_auto

        ppl = None
        if engine_json.exists():
            ppl = {k: v["ppl"] for k, v in json.loads(engine_json.read_text()).items()}
        m = weights_auto.measure(args.rounds)
        text = weights_auto.render(m, describe(args.threads), ppl)
        print(text)
        fill(args.doc, "nestedfp-auto", text)


PEER_SYSTEMS = ("kvserve-dense-fp32", "kvserve-bf16", "kvserve-nested-fp16", "kvserve-nested-fp8", "llamacpp")


def peers_part(args: argparse.Namespace) -> str:
    """Single-stream decode through each server (harness.serving's decode workload: one chat, 128 tokens,
    end of sequence ignored; tokens/s = 1 / ITL p50), llama.cpp's server on the Q4_1 GGUF the model
    comes from (`make bench-peer-llamacpp` builds it)."""
    from harness.compare import run_all
    from harness.report import summaries
    from harness.serving import VLLM_SIZE

    out = ROOT / "out" / "bench" / "weights_peers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):  # each round every server once, in a rotated order (run_all)
        data = run_all(
            list(PEER_SYSTEMS[r:] + PEER_SYSTEMS[:r]),
            ["decode"],
            VLLM_SIZE,
            out.with_suffix(f".{r}.json"),
            False,
        )
        rounds.append(summaries(data))
    rates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for name in PEER_SYSTEMS:
        values = [s.get((name, "decode", "c1"), {}).get("decode_tok_per_s") for s in rounds]
        ok = [v for v in values if v]
        rates[name] = statistics.median(ok) if ok else None
    for r in data["results"]:
        if "unavailable" in r:
            notes[r["system"]] = "unavailable: " + r["unavailable"].strip().splitlines()[-1][:160]
        elif r.get("note"):
            notes[r["system"]] = r["note"]
    fp32, llama = rates.get("kvserve-dense-fp32"), rates.get("llamacpp")
    lines = [
        f"Measured by `python scripts/bench_weights.py --part peers` on {describe()}: single-stream decode "
        f"through each server (one chat request, {VLLM_SIZE.decode_tokens} tokens, end of sequence "
        f"ignored; tokens/s = 1 / ITL p50 as the client sees the stream), {args.rounds} rounds with the "
        "servers in rotated order, medians.",
        "",
        "| server | decode tok/s | x kvserve fp32 | x llama.cpp |",
        "|---|---:|---:|---:|",
    ]

    def ratio(v: float | None, ref: float | None) -> str:
        return f"{v / ref:.2f}x" if v and ref else "-"

    for name in PEER_SYSTEMS:
        v = rates[name]
        value = f"{v:.1f}" if v else "-"
        lines.append(f"| {name} | {value} | {ratio(v, fp32)} | {ratio(v, llama)} |")
    lines += ["", *(f"- {k}: {v}" for k, v in notes.items())]
    return "\n".join(lines)


def kernel_part(args: argparse.Namespace) -> None:
    ext = cpu_ext.load()
    weights = step_weights(args.model)
    runs = kernels(ext, weights)
    results = {rows: measure(runs, rows, args.repeats) for rows in ROWS}
    text = render(args.model, args.threads, sum(w.numel() for w in weights), runs, results)
    print(text)
    fill(args.doc, "nestedfp-gemv", text)


if __name__ == "__main__":
    main()
