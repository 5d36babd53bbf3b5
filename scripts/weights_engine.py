"""The served model at each weight format, end to end through the engine (bench_weights.py --part
engine): resident weight bytes, single-stream and 8-way decode, perplexity. Each format runs in its own
process (`worker`), so its memory is its own; the formats alternate over the rounds.

    python scripts/weights_engine.py worker --format "nested fp8"    # one format, prints JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def perplexity(llm: Any) -> float:
    """exp(mean NLL) of PPL_TOPICS' first PPL_TOKENS tokens each, as the server scores prompts."""
    from pydoc_data.topics import topics

    from kvserve import SamplingParams

    prompts = [llm.tokenizer.encode(topics[t])[:PPL_TOKENS] for t in PPL_TOPICS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll = [-e.logprob for o in outs for e in (o.prompt_logprobs or []) if e is not None]
    return math.exp(sum(nll) / len(nll))


def decode_rate(llm: Any, batch: int, tokens: int, seed: int) -> float:
    """Generated tokens per second after the last first token, `batch` requests of short prompts."""
    from kvserve import SamplingParams

    prompts = [
        [{"role": "user", "content": f"Story {seed}-{i}: write about a lighthouse keeper."}]
        for i in range(batch)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (end - start)


def worker(name: str, repeats: int) -> dict[str, Any]:
    from kvserve import LLM

    started = time.perf_counter()
    llm = LLM(model="smollm2-135m", enable_prefix_caching=False, max_cache_bytes=300_000_000, **FORMATS[name])
    load_s = time.perf_counter() - started
    info = llm.engine.info
    decode_rate(llm, 1, 8, seed=-1)  # warm-up
    single = [decode_rate(llm, 1, DECODE_TOKENS, seed=r) for r in range(repeats)]
    batched = [decode_rate(llm, BATCH, BATCH_TOKENS, seed=100 + r) for r in range(max(1, repeats - 1))]
    return {
        "format": name,
        "load_s": load_s,
        "weight_bytes": info.weight_bytes,
        "num_params": info.num_params,
        "rss_mb": rss_mb(),
        "decode_1": statistics.median(single),
        "decode_8": statistics.median(batched),
        "ppl": perplexity(llm),
        "model_forward": info.model_forward,
    }


def run_all(rounds: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Every format in its own process, `rounds` times, alternating; the median of each measure."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FORMATS}
    for r in range(rounds):
        names = list(FORMATS)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cmd = [sys.executable, __file__, "worker", "--format", name, "--repeats", str(repeats)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["worker"])
    ap.add_argument("--format", choices=list(FORMATS), required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(worker(args.format, args.repeats)))


if __name__ == "__main__":
    main()
