"""A small request's latency beside background audits (issue 62.2), on a live kvserve.

Each burst warms 5 documents of Python's bundled docs (its own, so that an earlier burst's audit guard
cannot stop their reuse), then sends 12 concurrent RAG chats, each 4 of the documents in a new order,
with `reuse: any`, `recompute_strategy: cacheblend`, `audit: true` and `max_tokens: 2`: 12 audits
queue. While any audit is pending, a 6-token completion is sent every `--gap-s` seconds (1-2; the
issue sent one every 3-4 s, which times fewer of them while the audits run). Before the
first burst the same small request is timed alone (the baseline). Prints p50 / p99 of its latency
before and beside the audits, their ratio, and the most requests and background sequences /v1/stats
showed running.

    .venv/bin/python scripts/bench_background.py [--bursts 2] [--gap-s 1 2] [--out out/bench/background.json]

The server is started here (smollm2-135m, `--reuse any --recompute-strategy query --audit-rate 0.5`,
the issue's flags; more with `--server-args`) in its own process group and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.machine import describe  # noqa: E402
from harness.report import percentile  # noqa: E402
from harness.serving import load_tokenizer  # noqa: E402
from harness.texts import clip, corpus  # noqa: E402

SERVER_FLAGS = ("--reuse", "any", "--recompute-strategy", "query", "--audit-rate", "0.5")
NUM_DOCS, DOCS_PER_CHAT, DOC_TOKENS = 5, 4, 300
CHAT_OPTIONS = {"reuse": "any", "recompute_strategy": "cacheblend", "audit": True}


def documents(tokenizer, burst: int) -> list[str]:
    """The burst's NUM_DOCS documents of about DOC_TOKENS tokens, disjoint from every other burst's."""
    texts = [text for _, text in corpus() if len(text) > 6 * DOC_TOKENS]
    picked = texts[burst * NUM_DOCS : (burst + 1) * NUM_DOCS]
    return [clip(tokenizer, text, DOC_TOKENS) for text in picked]


def chats(docs: list[str], num_chats: int, rng: random.Random) -> list[list[dict[str, str]]]:
    """num_chats RAG chats over distinct orders of DOCS_PER_CHAT of the documents."""
    orders = rng.sample(list(itertools.permutations(range(len(docs)), DOCS_PER_CHAT)), num_chats)
    system = "Answer the question using only the documents the user provides."
    return [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": "\n\n".join(docs[i] for i in order) + "\n\nWhat do they have in common?",
            },
        ]
        for order in orders
    ]


class Bench:
    def __init__(self, base_url: str, model: str):
        import httpx
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        self.http = httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=60)
        self.model = model
        self.num_small = 0
        self.peak = {"running": 0, "background_running": 0, "background_waiting": 0}

    async def small(self) -> float:
        """One 6-token completion; its latency in seconds."""
        self.num_small += 1
        start = time.perf_counter()
        await self.client.completions.create(
            model=self.model,
            prompt=f"Note {self.num_small}: the weather today is",
            max_tokens=6,
            temperature=0,
        )
        return time.perf_counter() - start

    async def stats(self) -> dict:
        r = await self.http.get("/v1/stats")
        r.raise_for_status()
        body = r.json()
        for key in self.peak:  # background_* exist only where they are reported apart
            self.peak[key] = max(self.peak[key], body["queue"].get(key, 0))
        return body

    async def burst(self, docs: list[str], num_chats: int, rng: random.Random) -> dict[str, int]:
        """Warm the documents, send the chats at once; their reuse plans, what became of their audits
        (usage.kvserve.audit) and the tokens reused approximately."""
        for doc in docs:
            (await self.http.post("/v1/warm", json={"text": doc})).raise_for_status()
        outs = await asyncio.gather(
            *(
                self.client.chat.completions.create(
                    model=self.model, messages=m, max_tokens=2, temperature=0, extra_body=CHAT_OPTIONS
                )
                for m in chats(docs, num_chats, rng)
            )
        )
        audits: dict[str, int] = {}
        for out in outs:
            usage = (out.usage.model_extra or {}).get("kvserve", {})
            for outcome in [*(usage.get("audit") or {}), *(usage.get("reuse_plans") or {})]:
                audits[outcome] = audits.get(outcome, 0) + 1
            audits["approx_cached_tokens"] = (
                audits.get("approx_cached_tokens", 0) + usage["approx_cached_tokens"]
            )
        for doc in docs:
            (await self.http.request("DELETE", "/v1/warm", json={"text": doc})).raise_for_status()
        return audits

    async def beside_audits(
        self, gap_s: tuple[float, float], rng: random.Random
    ) -> tuple[list[float], float]:
        """Small requests every gap_s while audits are pending; (their latencies, seconds until none was)."""
        latencies: list[float] = []
        start = time.monotonic()
        while (await self.stats())["cache"]["reuse"]["num_audits_pending"] > 0:
            latencies.append(await self.small())
            await asyncio.sleep(rng.uniform(*gap_s))
        return latencies, time.monotonic() - start


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_s": percentile(values, 50), "p99_s": percentile(values, 99)}


async def measure(base_url: str, args: argparse.Namespace) -> dict:
    from openai import AsyncOpenAI

    models = await AsyncOpenAI(base_url=base_url, api_key="unused").models.list()
    bench = Bench(base_url, models.data[0].id)
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer()
    await bench.small()  # first request: warm-up, not counted
    baseline = []
    for _ in range(args.baseline):
        baseline.append(await bench.small())
        await asyncio.sleep(0.5)
    beside, bursts = [], []
    for b in range(args.bursts):
        audits = await bench.burst(documents(tokenizer, b), args.chats, rng)
        latencies, drain_s = await bench.beside_audits(tuple(args.gap_s), rng)
        beside += latencies
        bursts.append({"audits": audits, "small_requests": len(latencies), "audits_drained_s": drain_s})
    before, after = summary(baseline), summary(beside)
    return {
        "machine": describe(),
        "baseline": before,
        "beside_audits": after,
        "p50_ratio": after["p50_s"] / before["p50_s"] if after["n"] else None,
        "p99_ratio": after["p99_s"] / before["p99_s"] if after["n"] else None,
        "peak_queue": bench.peak,
        "bursts": bursts,
        "beside_latencies_s": beside,
        "baseline_latencies_s": baseline,
    }


def print_table(result: dict) -> None:
    print(f"machine: {result['machine']}")
    print(f"{'small request (6 tokens)':<28} {'n':>4} {'p50 s':>8} {'p99 s':>8}")
    for name in ("baseline", "beside_audits"):
        s = result[name]
        p50, p99 = (f"{v:.3f}" if v is not None else "-" for v in (s["p50_s"], s["p99_s"]))
        print(f"{name:<28} {s['n']:>4} {p50:>8} {p99:>8}")
    ratios = (result["p50_ratio"], result["p99_ratio"])
    print("ratio beside / baseline: p50 {}, p99 {}".format(*(f"{r:.2f}x" if r else "-" for r in ratios)))
    print(f"peak /v1/stats queue: {result['peak_queue']}")
    for i, b in enumerate(result["bursts"]):
        print(f"burst {i}: audits {b['audits']}, drained in {b['audits_drained_s']:.1f} s")


def main() -> None:
    from peers.launch import System, exit_on_sigterm, running

    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="measure an already running server (started with the issue's flags)")
    p.add_argument("--port", type=int, default=18350)
    p.add_argument("--server-args", default="", help="more kvserve flags, one string")
    # two bursts: 24 requested audits, within the default budget of 30 a minute
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--baseline", type=int, default=20, help="small requests timed before the first burst")
    p.add_argument(
        "--gap-s", type=float, nargs=2, default=(1.0, 2.0), help="seconds between small requests (uniform)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the result JSON here")
    args = p.parse_args()
    if args.base_url:
        result = asyncio.run(measure(args.base_url, args))
    else:
        argv = (
            str(Path(sys.executable).parent / "kvserve"),
            *("--model", "smollm2-135m", "--host", "127.0.0.1", "--port", "{port}"),
            *SERVER_FLAGS,
            *args.server_args.split(),
        )
        log = Path("out/bench/logs") / f"background-{args.port}.log"
        with running(System("kvserve", argv), args.port, log) as (_, base_url):
            result = asyncio.run(measure(base_url, args))
        result["server_flags"] = [*SERVER_FLAGS, *args.server_args.split()]
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
