"""`--weight-precision auto` under a load ramp, against fp16 and fp8 alone (bench_weights.py --part auto).

The ramp is open-loop: requests arrive at seeded Poisson times, the same times for every setting, in
phases whose rates are fractions of the fp16 capacity measured first (requests per second with 16 at
once). The latency objective is fixed before the ramp from the same calibration: `SLO_FACTOR` x the
TTFT of one fp16 request alone. Each setting runs in this process on a fresh engine; the engine is
driven as the server's worker drives it (new arrivals added between steps).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

PHASES = (0.5, 0.9, 1.1, 1.3)  # arrival rate / fp16 capacity
PHASE_S = 20.0
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 48
SLO_FACTOR = 4.0
SETTINGS = ("fp16", "fp8", "auto")


def prompts(llm: Any, n: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    ids = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    rng = random.Random(7)
    out = []
    for _ in range(n):
        start = rng.randrange(len(ids) - PROMPT_TOKENS)
        out.append(ids[start : start + PROMPT_TOKENS])
    return out


def engine(setting: str, slo_ms: float) -> Any:
    from kvserve import LLM

    return LLM(
        model="smollm2-135m",
        weight_precision=setting,
        slo_ttft_ms=slo_ms if setting == "auto" else 0.0,
        enable_prefix_caching=False,
        max_cache_bytes=400_000_000,
    )


def calibrate() -> tuple[float, float]:
    """(fp16 requests per second with 16 at once, TTFT of one fp16 request alone in seconds)."""
    from kvserve import SamplingParams

    llm = engine("fp16", 0.0)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    batch = prompts(llm, 17)
    llm.generate(batch[:1], params)  # warm-up
    alone = statistics.median(llm.generate([p], params)[0].metrics.ttft_s for p in batch[1:4])
    start = time.perf_counter()
    llm.generate(batch[1:17], params)
    return 16 / (time.perf_counter() - start), alone


def arrivals(capacity: float) -> list[tuple[float, int]]:
    """(arrival time from the start, phase index), seeded Poisson per phase."""
    rng = random.Random(11)
    out: list[tuple[float, int]] = []
    for k, fraction in enumerate(PHASES):
        t, end = k * PHASE_S, (k + 1) * PHASE_S
        while True:
            t += rng.expovariate(fraction * capacity)
            if t >= end:
                break
            out.append((t, k))
    return out


def run(setting: str, schedule: list[tuple[float, int]], slo_ms: float) -> list[dict[str, Any]]:
    from kvserve import SamplingParams
    from kvserve.request import Request

    llm = engine(setting, slo_ms)
    eng = llm.engine
    texts = prompts(llm, len(schedule))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    eng.add_request(Request("warm-up", texts[0], params))
    while eng.has_unfinished_requests():
        eng.step()
    results: list[dict[str, Any]] = []
    start = time.monotonic()
    pending = list(enumerate(schedule))
    while pending or eng.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1][0] <= now:
            i, (at, phase) = pending.pop(0)
            request = Request(f"r{i}-{phase}", texts[i], params)
            request.metrics.arrival_time = start + at  # open loop: waiting for a step counts
            eng.add_request(request)
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        for out in eng.step():
            if out.finished:
                results.append(
                    {
                        "phase": int(out.request_id.rsplit("-", 1)[1]),
                        "ttft": out.metrics.ttft_s,
                        "precision": out.weight_precision,
                    }
                )
    llm.close()
    return results


def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)] if s else float("nan")


def measure(rounds: int = 2) -> dict[str, Any]:
    """Every setting `rounds` times over the same arrivals, in a rotated order each round; a phase's
    TTFT p90 pools its requests over the rounds."""
    capacity, alone = calibrate()
    slo_ms = SLO_FACTOR * alone * 1000
    schedule = arrivals(capacity)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for r in range(rounds):
        for s in SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]:
            runs[s] += run(s, schedule, slo_ms)
    return {
        "capacity": capacity,
        "alone_s": alone,
        "slo_ms": slo_ms,
        "count": len(schedule),
        "rounds": rounds,
        "runs": runs,
    }


def render(m: dict[str, Any], machine: str, ppl: dict[str, float] | None) -> str:
    lines = [
        f"Measured by `python scripts/bench_weights.py --part auto` on {machine}. fp16 capacity "
        f"{m['capacity']:.2f} requests/s (16 at once); one fp16 request alone: TTFT {1000 * m['alone_s']:.0f} ms; "
        f"objective --slo-ttft-ms {m['slo_ms']:.0f} ({SLO_FACTOR:g}x that). {m['count']} requests of "
        f"{PROMPT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens arrive open-loop in {len(PHASES)} phases "
        f"of {PHASE_S:.0f} s at {', '.join(f'{f:g}' for f in PHASES)} x the fp16 capacity; the same "
        f"arrival times for each setting, {m['rounds']} rounds in rotated order (a phase's p90 pools them).",
        "",
        "| phase (x fp16 capacity) | "
        + " | ".join(f"{s}: TTFT p90 ms | {s}: met" for s in SETTINGS)
        + " | auto: served at fp8 |",
        "|---|" + "---:|---|" * len(SETTINGS) + "---:|",
    ]
    for k, fraction in enumerate(PHASES):
        cells = []
        for s in SETTINGS:
            value = p90([r["ttft"] for r in m["runs"][s] if r["phase"] == k])
            cells.append(f"{1000 * value:.0f} | {'yes' if 1000 * value <= m['slo_ms'] else 'no'}")
        auto = [r for r in m["runs"]["auto"] if r["phase"] == k]
        share = sum(r["precision"] == "fp8" for r in auto) / max(1, len(auto))
        lines.append(f"| {fraction:g} | " + " | ".join(cells) + f" | {100 * share:.0f} % |")
    if ppl:
        auto = m["runs"]["auto"]
        share = sum(r["precision"] == "fp8" for r in auto) / max(1, len(auto))
        lines += [
            "",
            f"Quality: auto served {100 * share:.0f} % of all requests at fp8, whose perplexity is "
            f"{100 * (ppl['nested fp8'] / ppl['nested fp16'] - 1):+.2f} % against fp16 (the engine part above); "
            "the rest exactly as fp16.",
        ]
    return "\n".join(lines)
