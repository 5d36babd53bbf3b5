"""`kvserve cluster` on this machine: prefix-affinity routing against round-robin, 2 replicas against
1, and a prefix warmed on one replica served by another through Redis. Writes docs/scale-out.md
(between the cluster markers) and docs/img/cluster_ttft.png.

Workload: the 8-chat shared-system-prompt burst (scripts/bench_serving.py `burst`) with `--systems`
distinct system prompts: each burst sends `--chats` chats for every system prompt at once (each its
own question, shuffled), `--rounds` bursts in all (new questions each time): the first finds nothing
cached, the later ones find the system prompts. Streamed, `--max-tokens` greedy tokens each. Every
configuration gets a fresh cluster (one warm-up chat per replica) and an emptied Redis, and the same
requests in the same order:

- affinity, 2 replicas: prefix-affinity routing, `--replica-cpus 1`;
- round-robin, 2 replicas: the same, each request to the next replica in turn;
- 1 replica: one engine with both CPUs and both pools' bytes.

Each replica's pool holds about `--pool-prompts` of the system prompts (the regime routing is for:
the working set does not fit one replica). The prefix hit rate is the cluster's cached prompt tokens
over prompt tokens (/v1/stats). Cross-replica: `--trials` fresh prefixes are each warmed with
/v1/warm (on replica A, where the router sends them), then asked on B (X-KVServe-Replica: its pool
misses, Redis has the chunks) and on A (its pool hits); the TTFTs' medians are compared.

    python scripts/bench_cluster.py [--quick] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness.docs import fill
from harness.machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.cluster import app  # noqa: E402
from kvserve.cluster.config import ClusterConfig  # noqa: E402
from kvserve.config import ServeConfig  # noqa: E402
from kvserve.models.loader import resolve_model_path  # noqa: E402
from kvserve.tokenizer import Tokenizer  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

REPLICA = "x-kvserve-replica"
BYTES_PER_TOKEN = 23040  # SmolLM2-135M in bf16 (the pool budget is in bytes)


def texts(tokenizer: Any, n: int, num_tokens: int, offset: int) -> list[str]:
    """n distinct texts of num_tokens tokens each, cut from Python's own documentation."""
    from pydoc_data.topics import topics

    corpus = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    return [
        tokenizer.decode(corpus[offset + i * num_tokens : offset + (i + 1) * num_tokens]) for i in range(n)
    ]


def workload(systems: list[str], chats: int, rounds: int, seed: int) -> list[list[dict[str, Any]]]:
    """The bursts: each a shuffled list of chats (system prompt, question)."""
    rng = random.Random(seed)
    bursts = []
    for r in range(rounds):
        batch = [
            {
                "system": s,
                "tag": f"s{i}",
                "user": f"Round {r}, chat {c}: what does section {rng.randrange(999)} say?",
            }
            for i, s in enumerate(systems)
            for c in range(chats)
        ]
        rng.shuffle(batch)
        bursts.append(batch)
    return bursts


async def ttft(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int, headers: dict[str, str]
) -> dict[str, Any]:
    """Stream one chat; the time to its first content token, the replica and the usage."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, usage = None, None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        replica = r.headers.get(REPLICA)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if first is None and choice.get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    return {"ttft_s": first, "replica": replica, "usage": usage}


async def run_bursts(base: str, bursts: list[list[dict[str, Any]]], max_tokens: int) -> dict:
    """Each burst's chats all at once; the next burst when the last one ended."""
    records: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, r: dict[str, Any], burst: int) -> None:
        messages = [{"role": "system", "content": r["system"]}, {"role": "user", "content": r["user"]}]
        records.append({"tag": r["tag"], "burst": burst, **await ttft(client, messages, max_tokens, {})})

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        for b, burst in enumerate(bursts):
            await asyncio.gather(*(one(client, r, b) for r in burst))
    return {"records": records, "wall_s": time.perf_counter() - t0}


async def warm_up(base: str, max_tokens: int) -> None:
    """One unrelated chat on each replica: the first forward's one-time costs are not measured."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for replica in (await client.get("/v1/stats")).json()["replicas"]:
            messages = [{"role": "user", "content": f"Warm-up {replica}: say hello."}]
            await ttft(client, messages, max_tokens, {REPLICA: replica})
        stats = (await client.get("/v1/stats")).json()
    assert stats["queue"]["completed"] == len(stats["replicas"]), stats["queue"]


async def cross_replica(base: str, prefixes: list[str], max_tokens: int) -> list[dict[str, float]]:
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        replicas = list((await client.get("/v1/stats")).json()["replicas"])
        for i, prefix in enumerate(prefixes):
            warm = await client.post(
                "/v1/warm", json={"messages": [{"role": "system", "content": prefix}], "pin": False}
            )
            warm.raise_for_status()
            a = warm.headers[REPLICA]
            b = next(r for r in replicas if r != a)
            row = {}
            for name, replica in (("B", b), ("A", a)):  # B first: A's answer must not help B
                question = f"Question {i}{name}: summarise the reference in one line."
                messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
                out = await ttft(client, messages, max_tokens, {REPLICA: replica})
                assert out["replica"] == replica, (out["replica"], replica)
                row[name] = out["ttft_s"]
                row[name + "_cached"] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            rows.append(row)
    return rows


def p50(values: list[float]) -> float:
    return statistics.median(values)


def run_config(
    name: str, config: ServeConfig, cluster: ClusterConfig, bursts: list[list[dict]], args: argparse.Namespace
) -> dict[str, Any]:
    print(f"== {name}: starting {cluster.replicas} replica(s)", flush=True)
    app.start(config, cluster)
    base = f"http://127.0.0.1:{config.port}"
    try:
        asyncio.run(warm_up(base, args.max_tokens))
        result = asyncio.run(run_bursts(base, bursts, args.max_tokens))
        stats = httpx.get(base + "/v1/stats", timeout=60).json()
    finally:
        app.stop()
    records = result["records"]
    prompt = sum(r["usage"]["prompt_tokens"] for r in records)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records)
    placement: dict[str, set[str]] = {}
    for r in records:
        placement.setdefault(r["tag"], set()).add(r["replica"])
    out = {
        "name": name,
        "replicas": cluster.replicas,
        "routing": cluster.routing,
        "ttft_p50_s": p50([r["ttft_s"] for r in records]),
        "ttft_p50_first_s": p50([r["ttft_s"] for r in records if r["burst"] == 0]),
        "ttft_p50_later_s": p50([r["ttft_s"] for r in records if r["burst"] > 0] or [0.0]),
        "ttft_p95_s": sorted(r["ttft_s"] for r in records)[int(0.95 * (len(records) - 1))],
        "hit_rate": cached / prompt,
        "stats_hit_rate": stats["cache"]["hit_rate"],
        "redis_loads": stats["cache"]["tiers"].get("redis", {}).get("loads", 0),
        "prompt_tokens_computed": stats["tokens"]["prompt_tokens_computed"],
        "wall_s": result["wall_s"],
        "replicas_per_system": {tag: len(rs) for tag, rs in sorted(placement.items())},
        "requests_per_replica": sorted(
            (sum(r["replica"] == rid for r in records) for rid in {r["replica"] for r in records}),
            reverse=True,
        ),
        "decisions": stats["cluster"]["routing"]["decisions"],
        "ttfts": [r["ttft_s"] for r in records],
    }
    print(json.dumps({k: v for k, v in out.items() if k != "ttfts"}), flush=True)
    return out


def report(results: list[dict], cross: list[dict], args: argparse.Namespace, header: str) -> str:
    by = {r["name"]: r for r in results}
    aff, rr, one = by["affinity, 2 replicas"], by["round-robin, 2 replicas"], by["1 replica"]
    lines = [
        header,
        "",
        "| configuration | TTFT p50 (ms) | p50, first burst | p50, later bursts | TTFT p95 (ms) "
        "| prefix hit rate | prompt tokens computed | Redis loads (chunks) | wall (s) "
        "| replicas per system prompt | requests per replica |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        spread = ",".join(str(n) for n in r["replicas_per_system"].values())
        lines.append(
            f"| {r['name']} | {1000 * r['ttft_p50_s']:.1f} | {1000 * r['ttft_p50_first_s']:.1f} "
            f"| {1000 * r['ttft_p50_later_s']:.1f} | {1000 * r['ttft_p95_s']:.1f} "
            f"| {100 * r['hit_rate']:.1f} % | {r['prompt_tokens_computed']} | {r['redis_loads']} "
            f"| {r['wall_s']:.1f} | {spread} | {'/'.join(map(str, r['requests_per_replica']))} |"
        )
    b = p50([c["B"] for c in cross])
    a = p50([c["A"] for c in cross])
    lines += [
        "",
        "| measure | target | measured |",
        "|---|---|---:|",
        f"| prefix hit rate, prefix-affinity routing | >= 90 % | {100 * aff['hit_rate']:.1f} % |",
        f"| TTFT p50, round-robin / prefix-affinity | >= 2x | {rr['ttft_p50_s'] / aff['ttft_p50_s']:.2f}x |",
        f"| (first burst: nothing cached) | | {rr['ttft_p50_first_s'] / aff['ttft_p50_first_s']:.2f}x |",
        f"| (later bursts: system prompts cached) | | {rr['ttft_p50_later_s'] / aff['ttft_p50_later_s']:.2f}x |",
        f"| prompt tokens computed, round-robin / prefix-affinity | (reported) "
        f"| {rr['prompt_tokens_computed'] / aff['prompt_tokens_computed']:.2f}x |",
        f"| warm TTFT on B for a prefix warmed on A, / A's local | <= 2x | {b / a:.2f}x |",
        f"| TTFT p50, 1 replica / 2 replicas (affinity) | (reported) | {one['ttft_p50_s'] / aff['ttft_p50_s']:.2f}x |",
        f"| wall time, 1 replica / 2 replicas (affinity) | (reported) | {one['wall_s'] / aff['wall_s']:.2f}x |",
        "",
        f"Cross-replica ({len(cross)} prefixes of {args.cross_tokens} tokens): TTFT p50 on B (Redis) "
        f"{1000 * b:.1f} ms, on A (its pool) {1000 * a:.1f} ms; cached prompt tokens on B "
        f"{min(c['B_cached'] for c in cross)}-{max(c['B_cached'] for c in cross)}, on A "
        f"{min(c['A_cached'] for c in cross)}-{max(c['A_cached'] for c in cross)}.",
        "",
        "![TTFT by configuration](img/cluster_ttft.png)",
    ]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        xs = sorted(1000 * t for t in r["ttfts"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r["name"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("kvserve cluster: TTFT CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pool-prompts", type=float, default=3.5)
    ap.add_argument("--cross-tokens", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--quick", action="store_true", help="2 bursts, 2 trials, 512-token prompts")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "scale-out.md")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.trials, args.system_tokens, args.cross_tokens = 2, 2, 512, 512
    pool = int(args.pool_prompts * (args.system_tokens + 64) * BYTES_PER_TOKEN)
    results, cross = [], []
    with RedisServer() as redis:
        base_cfg = ServeConfig(model=args.model, kv_redis_url=redis.url, port=args.port, max_cache_bytes=pool)
        configs = [
            ("affinity, 2 replicas", base_cfg, ClusterConfig(replicas=2, replica_cpus=1)),
            (
                "round-robin, 2 replicas",
                base_cfg,
                ClusterConfig(replicas=2, replica_cpus=1, routing="round-robin"),
            ),
            (
                "1 replica",
                ServeConfig(**{**base_cfg.__dict__, "max_cache_bytes": 2 * pool}),
                ClusterConfig(replicas=1, replica_cpus=2),
            ),
        ]
        tokenizer = Tokenizer(resolve_model_path(args.model))
        systems = texts(tokenizer, args.systems, args.system_tokens, 0)
        prefixes = texts(tokenizer, args.trials, args.cross_tokens, args.systems * args.system_tokens)
        system = "You are a Python documentation assistant.\n\n"
        bursts = workload([system + s for s in systems], args.chats, args.rounds, seed=0)
        for i, (name, config, cluster) in enumerate(configs):
            redis.flush()
            results.append(run_config(name, config, cluster, bursts, args))
            if i == 0:  # cross-replica reuse, on the affinity cluster (started again: a clean state)
                redis.flush()
                app.start(config, cluster)
                try:
                    cross = asyncio.run(
                        cross_replica(f"http://127.0.0.1:{config.port}", prefixes, args.max_tokens)
                    )
                finally:
                    app.stop()
                print("cross-replica:", json.dumps(cross), flush=True)
    from ray import serve

    serve.shutdown()
    header = (
        f"Measured by `python scripts/bench_cluster.py{' --quick' if args.quick else ''}` on {describe(1)} "
        f"per replica (the single replica: 2 CPUs, 2 threads); model {args.model}, {args.systems} system prompts of {args.system_tokens} tokens x "
        f"{args.chats} chats each, {args.rounds} bursts (each: every chat at once), {args.max_tokens} "
        f"tokens each; each replica's pool {pool / 1e6:.0f} MB (about {args.pool_prompts} system prompts)."
    )
    text = report(results, cross, args, header)
    print(text)
    plot(results, ROOT / "docs" / "img" / "cluster_ttft.png")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "cross": cross}, indent=1))
    fill(args.doc, "cluster", text)


if __name__ == "__main__":
    main()
