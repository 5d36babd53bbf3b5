"""What one output costs at the start of a long generation and at its end (issue 34: outputs as deltas).

One request, --tokens greedy tokens with logprobs=5 (ignore_eos), stepped through the engine. Per
output: the time the engine spends building it (OutputProcessor.delta), its pickled size and the
time to pickle it (what a cluster replica sends through Ray for each token), and, beside it, the
same figures for the cumulative output the engine sent before (every token, the whole text and every
logprob so far: the same output with those fields filled). Medians over the first and the last
--window outputs; the step time (model forward included, which grows with the context) for scale.

With --ray, the first and the last window's outputs (deltas, and the cumulative ones beside them) are
then sent through Ray as a cluster replica sends them: a streaming Ray task yields them one by one to
this process, which times each arrival (its transfer and unpickling; the task runs on one CPU).

    python scripts/bench_output_deltas.py --tokens 4000 --ray
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.machine import describe  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.request import Request, RequestOutput  # noqa: E402


def pickled(out: RequestOutput) -> tuple[int, float]:
    start = time.perf_counter()
    size = len(pickle.dumps(out))
    return size, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--ray", action="store_true", help="also time the outputs through a Ray stream")
    args = ap.parse_args()
    llm = LLM(
        model=args.model, max_cache_bytes=400_000_000, request_timeout_s=24 * 3600.0
    )  # a long run is not a timeout
    engine = llm.engine
    build_s: list[float] = []
    real_delta = engine.outputs.delta

    def timed_delta(seq, *rest):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = real_delta(seq, *rest)
        build_s.append(time.perf_counter() - start)
        return out

    engine.outputs.delta = timed_delta  # type: ignore[method-assign]
    prompt = llm.to_token_ids([{"role": "user", "content": "Write a very long story about a lighthouse."}])
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=5)
    engine.add_request(Request("long", prompt, params))
    rows: list[dict[str, float]] = []
    first_outs: list[tuple[RequestOutput, RequestOutput]] = []  # (delta, cumulative) of the first window
    last_outs: collections.deque[tuple[RequestOutput, RequestOutput]] = collections.deque(maxlen=args.window)
    tokens, text, logprobs = [], "", []
    done = False
    while not done:
        start = time.perf_counter()
        outs = engine.step()
        step_s = time.perf_counter() - start
        for out in outs:
            done |= out.finished
            if out.finished:
                final = out
            if out.finished or not out.new_token_ids:
                continue
            tokens += out.new_token_ids
            text += out.new_text
            logprobs += out.new_logprobs or []
            start = time.perf_counter()  # the copies the cumulative output made (on top of the delta's)
            cumulative = dataclasses.replace(out, token_ids=list(tokens), text=text, logprobs=list(logprobs))
            copy_s = time.perf_counter() - start
            if len(first_outs) < args.window:
                first_outs.append((out, cumulative))
            last_outs.append((out, cumulative))
            size, pickle_s = pickled(out)
            old_size, old_pickle_s = pickled(cumulative)
            rows.append(
                {
                    "build_us": build_s[-1] * 1e6,
                    "old_build_us": (build_s[-1] + copy_s) * 1e6,
                    "bytes": size,
                    "pickle_us": pickle_s * 1e6,
                    "old_bytes": old_size,
                    "old_pickle_us": old_pickle_s * 1e6,
                    "step_ms": step_s * 1e3,
                }
            )
    w = min(args.window, len(rows) // 2)
    first, last = rows[:w], rows[-w:]
    print(f"## {args.model}: one request, {len(final.token_ids)} tokens ({final.finish_reason}), logprobs=5")
    print(describe())
    print(f"medians over the first and the last {w} outputs (one token each)\n")
    print("| per output | first | last | last / first |")
    print("|---|---|---|---|")
    for key, label in [
        ("build_us", "engine: building the output (us)"),
        ("old_build_us", "engine: building it cumulative, as before (us)"),
        ("bytes", "pickled size, delta (bytes)"),
        ("pickle_us", "pickling, delta (us)"),
        ("old_bytes", "pickled size, cumulative as before (bytes)"),
        ("old_pickle_us", "pickling, cumulative as before (us)"),
        ("step_ms", "engine step, forward included (ms)"),
    ]:
        a = statistics.median(r[key] for r in first)
        b = statistics.median(r[key] for r in last)
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {b / a:.2f} |")
    llm.close()
    if args.ray:
        through_ray(first_outs[:w], list(last_outs)[-w:])


def through_ray(
    first: list[tuple[RequestOutput, RequestOutput]], last: list[tuple[RequestOutput, RequestOutput]]
) -> None:
    """Median seconds per output arriving from a streaming Ray task, first window against last."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_returns="streaming")
    def replay(outs: list[RequestOutput]):  # type: ignore[no-untyped-def]
        for out in outs:  # noqa: UP028 (not `yield from`: Ray drives the generator with send())
            yield out

    def per_output_us(outs: list[RequestOutput]) -> float:
        times = []
        stream = replay.remote(outs)
        t = time.perf_counter()
        for ref in stream:
            ray.get(ref)
            now = time.perf_counter()
            times.append(now - t)
            t = now
        return statistics.median(times[1:]) * 1e6  # the first waits for the task to start

    print(
        f"\nthrough Ray ({ray.__version__}): a streaming task yields each window's outputs to this process\n"
    )
    print("| per output | first | last | last / first |")
    print("|---|---|---|---|")
    for label, k in (("delta (us)", 0), ("cumulative, as before (us)", 1)):
        a = per_output_us([pair[k] for pair in first])
        b = per_output_us([pair[k] for pair in last])
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {b / a:.2f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
