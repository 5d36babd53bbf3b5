"""The engine part of bench_weights.py: the served model in each weight format, end to end through the
engine (resident weight bytes, single-stream and 8-way decode, perplexity). Each format runs in its
own process (scripts/weights_engine.py worker), so its memory is its own; the formats alternate over
the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parents[1] / "weights_engine.py"  # one format, in its own process

# name -> LLM keyword arguments
FORMATS: dict[str, dict[str, Any]] = {
    "fp32, HF modeling code": {"dtype": "float32", "model_forward": "hf"},
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "nested fp16": {"weight_precision": "fp16"},
    "nested fp8": {"weight_precision": "fp8"},
}
PPL_TOPICS = ("formatstrings", "string-methods", "typesmapping", "import")  # pydoc_data.topics
PPL_TOKENS = 512
DECODE_TOKENS = 128
BATCH = 8
BATCH_TOKENS = 64


def run_all(rounds: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Every format in its own process, `rounds` times, alternating; the median of each measure."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FORMATS}
    for r in range(rounds):
        names = list(FORMATS)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cmd = [sys.executable, str(WORKER), "worker", "--format", name, "--repeats", str(repeats)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name} done", file=sys.stderr)
    merged: dict[str, dict[str, Any]] = {}
    for name, rows in runs.items():
        merged[name] = dict(rows[0])
        for key in ("load_s", "rss_mb", "decode_1", "decode_8"):
            merged[name][key] = statistics.median(row[key] for row in rows)
    return merged


def render(results: dict[str, dict[str, Any]], machine: str, rounds: int, repeats: int) -> str:
    fp32 = results["fp32"]
    lines = [
        f"Measured by `python scripts/bench_weights.py --part engine` on {machine}: SmolLM2-135M served by "
        f"the engine (prefix caching off), each format in its own process, {rounds} rounds alternating "
        f"formats, medians. Single-stream: one chat request, {DECODE_TOKENS} tokens (median of {repeats}); "
        f"8-way: {BATCH} requests at once, {BATCH_TOKENS} tokens each; both are generated tokens per "
        "second after the last first token. Perplexity: the engine's prompt logprobs over "
        f"{len(PPL_TOPICS)} texts x {PPL_TOKENS} tokens (Python's bundled docs: {', '.join(PPL_TOPICS)}). "
        "Weight bytes: every weight tensor the model holds, counted once (the dense formats include "
        "the CPU kernel's packed copy of each linear weight); RSS: the process after the runs.",
        "",
        "| format | weight bytes | bytes / param | RSS MiB | decode tok/s, 1 stream | x fp32 | "
        "decode tok/s, 8-way | x fp32 | perplexity | vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['weight_bytes'] / 1e6:.0f} MB | {r['weight_bytes'] / r['num_params']:.3f} | "
            f"{r['rss_mb']:.0f} | {r['decode_1']:.1f} | {r['decode_1'] / fp32['decode_1']:.2f}x | "
            f"{r['decode_8']:.1f} | {r['decode_8'] / fp32['decode_8']:.2f}x | {r['ppl']:.4f} | "
            f"{100 * (r['ppl'] / fp32['ppl'] - 1):+.2f} % |"
        )
    n8, n16 = results["nested fp8"], results["nested fp16"]
    lines += [
        "",
        f"8-way decode, nested fp8 against nested fp16: {n8['decode_8'] / n16['decode_8']:.2f}x; single "
        f"stream {n8['decode_1'] / n16['decode_1']:.2f}x.",
    ]
    return "\n".join(lines)
