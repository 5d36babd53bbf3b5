"""The engine's own cost per decode step: schedule, attention metadata, sampling, update, outputs.

Runs `tiny-random-llama` (its forward costs almost nothing, so a step's time is the engine's work):
`batch` prompts of `prompt_len` tokens each, greedy, `tokens` new tokens each, and reports the median
wall time of the decode steps (every request decoding, none prefilling) per batch size; `--profile`
adds a cProfile of those steps at the largest batch size (the top functions by cumulative time).

    python scripts/bench_step_overhead.py [--batch 1 32 128] [--tokens 64] [--profile] [--out F.json]

The CPU-time column is the robust one on a shared machine with `--threads 1` (with more threads it
counts their spin-waits too). Issue 63's targets: a step at batch 128 <= 4 ms and at batch 1 <= 0.5 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import pstats
import statistics
import time

import torch
from harness.machine import describe, machine

from kvserve import LLM, SamplingParams
from kvserve.request import sample_requests

FINAL_ONLY = "final_only" in inspect.signature(sample_requests).parameters


def decode_step_times(
    llm: LLM, batch: int, prompt_len: int, tokens: int, seed: int, profiler=None, deltas: bool = False
) -> list[tuple[float, float]]:
    """Adds `batch` greedy requests, steps until all have their first token, then times each step while
    all of them decode: (wall seconds, this process's CPU seconds) per step. Without `deltas` the
    requests are final-only, as LLM.generate's are; with it each step builds every request's delta, as
    the server's do."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 1000
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    requests = []
    for i in range(batch):
        ids = torch.randint(10, min(vocab, 1000), (prompt_len,), generator=gen).tolist()
        kind = {} if deltas or not FINAL_ONLY else {"final_only": True}  # an older tree has no final_only
        requests += sample_requests(f"s{seed}-{i}", ids, params, None, None, **kind)
    engine.add_requests(requests)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(engine.scheduler.running)
        if profiler is not None:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        dt = (time.perf_counter() - t0, time.process_time() - c0)
        if profiler is not None:
            profiler.disable()
        if decoding == batch:
            times.append(dt)
    return times[1:]  # the first decode step after prefill warms caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch size; the median of all steps")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--deltas", action="store_true", help="a delta output per request per step (the server's)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model="tiny-random-llama", max_num_seqs=max(args.batch), max_cache_bytes=200_000_000)
    decode_step_times(llm, 4, args.prompt_len, 8, seed=0)  # warm-up
    rows = []
    kind = (
        "a delta per request per step (server)"
        if args.deltas or not FINAL_ONLY
        else "final-only (LLM.generate)"
    )
    print(f"# engine step overhead, tiny-random-llama, {kind}; {describe()}")
    print("| batch | decode step p50 (ms) | min (ms) | CPU time p50 (ms) | steps |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        times: list[tuple[float, float]] = []
        for r in range(args.repeats):
            times += decode_step_times(
                llm, b, args.prompt_len, args.tokens, seed=1000 * b + r, deltas=args.deltas
            )
        wall = [w for w, _ in times]
        p50, lo = statistics.median(wall) * 1e3, min(wall) * 1e3
        cpu = statistics.median(c for _, c in times) * 1e3
        rows.append({"batch": b, "p50_ms": p50, "min_ms": lo, "cpu_p50_ms": cpu, "steps": len(times)})
        print(f"| {b} | {p50:.2f} | {lo:.2f} | {cpu:.2f} | {len(times)} |")
    if args.profile:
        prof = cProfile.Profile()
        b = max(args.batch)
        n = (
            len(
                decode_step_times(
                    llm, b, args.prompt_len, args.tokens, seed=7, profiler=prof, deltas=args.deltas
                )
            )
            + 2
        )
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        print(
            f"\n# cProfile over {n} steps at batch {b} (cumulative seconds; divide by steps)\n{s.getvalue()}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"machine": machine(), "rows": rows, "tokens": args.tokens, "deltas": args.deltas},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
