"""Where a model step's time goes: linear layers (GEMMs), attention (the KV write and the kernel), and
everything else (per-op dispatch through the modeling code, norms, RoPE, activations, Python).

Times each linear's forward and each attention backend call with a wall clock around it, inside real
engine steps (decode at batch 1 and 8, 8 decoding over a shared 1.4k-token prefix as in the burst
workload, and a prefill), and reports per-step medians:

    python scripts/profile_step.py [--dtype float32 bfloat16] [--threads 2] [--steps 30]
                                   [--cases decode prefill] [--prefill-runs 5] [--extra model_forward=hf]

The wall-clock wrappers add a little time of their own to "linear" and "attention" (two clock reads per
call); "other" is the step's time minus those, so it is what a fused or compiled forward could remove.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from harness.machine import describe
from harness.texts import corpus_tokens

from kvserve import LLM, SamplingParams
from kvserve.models.fused_llama import FusedLinear, FusedLlamaForward
from kvserve.models.nested import NestedLinear
from kvserve.request import Request

Timers = dict[str, float]


@contextmanager
def timed_calls(llm: LLM, timers: Timers) -> Iterator[None]:
    """Adds the wall time of every linear forward (module or fused call) and attention call to
    timers['linear'/'attention']."""
    runner = llm.engine.runner
    patched: list[tuple[Any, str, Any]] = []
    depth: dict[str, int] = defaultdict(int)  # a timed call inside another of its key counts once

    def wrap(obj: Any, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            if depth[key]:
                return fn(*a, **k)
            depth[key] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t0
                depth[key] -= 1

        patched.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed)

    inner: set[int] = set()  # an nn.Linear wrapped by a kernel's module: timed through its wrapper
    for module in runner.model.modules():
        if type(module).__name__.endswith("Linear") and type(module) is not torch.nn.Linear:
            inner.update(id(c) for c in module.children())
            wrap(module, "forward", "linear")
    for module in runner.model.modules():
        if type(module) is torch.nn.Linear and id(module) not in inner:
            wrap(module, "forward", "linear")
    if runner.fused is not None:  # its projections are FusedLinear calls, not module forwards
        wrap(FusedLinear, "__call__", "linear")
        wrap(FusedLlamaForward, "gated", "linear")  # gate|up with the activation (row_linear_glu)
        wrap(NestedLinear, "run", "linear")  # NestedFP projections and LM head (--weight-precision)
    wrap(runner.backend, "forward", "attention")
    for layer in runner.layers:
        wrap(layer, "write", "attention")
    try:
        yield
    finally:
        for obj, attr, own in reversed(patched):  # back to the class's method, or the instance's own
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)


def profile_decode(llm: LLM, batch: int, steps: int, seed: int, shared_prefix: int = 0) -> dict[str, float]:
    """Decode steps of `batch` sequences of 64-token prompts, after a common `shared_prefix` tokens (the
    burst workload's shape: chats over one cached system prompt)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [f"p{seed}-{i}" for i in range(batch)]
    prefix = corpus_tokens(llm, shared_prefix, seed * 1000) if shared_prefix else []
    if prefix:  # cached first, so that the 8 hit it and decode over the same blocks
        llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    for rid, i in zip(ids, range(batch)):
        engine.add_request(Request(rid, prefix + corpus_tokens(llm, 64, seed * 100 + i), params))
    while any((s := engine.scheduler.find(r)) is not None and not s.output_token_ids for r in ids):
        engine.step()  # prefills
    return measure_steps(llm, steps, finish=lambda: any(engine.scheduler.find(r) for r in ids))


def measure_steps(llm: LLM, steps: int, finish: Callable[[], bool]) -> dict[str, float]:
    rows: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        timers: Timers = defaultdict(float)
        with timed_calls(llm, timers):
            t0 = time.perf_counter()
            llm.engine.step()
            total = time.perf_counter() - t0
        rows["step"].append(total)
        rows["linear"].append(timers["linear"])
        rows["attention"].append(timers["attention"])
        rows["other"].append(total - timers["linear"] - timers["attention"])
    while finish():
        llm.engine.step()
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def profile_prefill(llm: LLM, tokens: int, seed: int, runs: int = 1) -> dict[str, float]:
    """One cold prompt of `tokens` tokens, `runs` times (other prompts each time): the run of median
    step time."""
    results = []
    for run in range(runs):
        timers: Timers = defaultdict(float)
        ids = corpus_tokens(llm, tokens, seed + 1000 * run)
        with timed_calls(llm, timers):
            t0 = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
            total = time.perf_counter() - t0
        results.append(
            {
                "step": total * 1e3,
                "linear": timers["linear"] * 1e3,
                "attention": timers["attention"] * 1e3,
                "other": (total - timers["linear"] - timers["attention"]) * 1e3,
            }
        )
    return sorted(results, key=lambda r: r["step"])[len(results) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--shared-prefix", type=int, default=1400, help="the shared-prefix decode case's prefix")
    ap.add_argument("--prefill-runs", type=int, default=1, help="prefills timed (the median is reported)")
    ap.add_argument("--cases", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--extra", nargs="*", default=[], help="ServeConfig overrides, key=value")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    extra = dict(kv.split("=", 1) for kv in args.extra)
    print(f"# profile_step: {args.model}; {describe(args.threads)}")
    print("| dtype | case | step (ms) | linear | attention | other | other / step |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        llm = LLM(model=args.model, dtype=dtype, max_cache_bytes=1_000_000_000, **extra)
        llm.generate([corpus_tokens(llm, 256, 0)], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        cases = []
        if "decode" in args.cases:
            cases += [(f"decode x{b}", profile_decode(llm, b, args.steps, seed=b)) for b in (1, 8)]
            cases.append(
                (
                    f"decode x8, shared {args.shared_prefix}-token prefix",
                    profile_decode(llm, 8, args.steps, seed=9, shared_prefix=args.shared_prefix),
                )
            )
        if "prefill" in args.cases:
            prefill = profile_prefill(llm, args.prefill_tokens, seed=7, runs=args.prefill_runs)
            cases.append((f"prefill {args.prefill_tokens}", prefill))
        for name, r in cases:
            print(
                f"| {dtype} | {name} | {r['step']:.1f} | {r['linear']:.1f} | {r['attention']:.1f} "
                f"| {r['other']:.1f} | {r['other'] / r['step']:.0%} |"
            )
        del llm


if __name__ == "__main__":
    main()
