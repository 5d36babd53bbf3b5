"""KV tiers on this CPU: time to first token by the tier a 2k-token prefix comes from, the cold
tier's density and agreement, written to docs/tiers.md (between the `tiers:start` / `tiers:end`
markers) with a plot (docs/img/tiers_ttft.png).

Method (kvserve.LLM in this process, SmolLM2-135M, `--dtype` auto, default codec):
- A prefix of `--prefix-tokens` tokens of English text is warmed; each measured request is that
  prefix plus a fresh 16-token question, greedy, 1 output token, so its time to first token is
  what the prefix's KV cost to get: TTFT = first token time - arrival time, from the engine's own
  request metrics. Every row is the median of `--trials` requests, each with its own question.
- compute: prefix caching off (every token computed).
- RAM hit: the prefix is in the hot pool.
- disk after restart: a first engine warms the prefix into a disk tier and is closed; a new engine
  on the same directory (the restart) serves the request: its chunks are loaded from disk. The files
  are in the page cache, as after a process restart on the same host.
- Redis hit: a first engine writes the prefix's chunks through to a real redis-server (started
  here on a free port); a new engine with an empty pool reads them from Redis.
- cold tier: an engine with a cold area (turbo3) warms the prefix unpinned, demotes it
  (`demote_idle`), and serves the request: its chunks are promoted.
Restarted engines are built fresh for each trial; every engine first runs one unrelated request of
the same shape (a different text of the prefix's length + a question), so that the measured request
after a restart pays the tier's cost and not a fresh engine's first-forward costs. The cold tier's agreement: greedy 32-token continuations of `--agree-prompts`
prompts (prefix + question) from the hot pool and after demotion and promotion, compared token by
token (the share of prompts whose continuations are identical, and the mean share of equal tokens
before the first difference).

    python scripts/bench_tiers.py [--prefix-tokens 2048] [--trials 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness.machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve import LLM, SamplingParams  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

MODEL = "smollm2-135m"
QUESTION_TOKENS = 16
FIRST = SamplingParams(max_tokens=1, temperature=0)
START, END = "<!-- tiers:start -->", "<!-- tiers:end -->"


def text_ids(llm: LLM, n: int, seed: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    start = (seed * 7919) % (len(ids) - n)
    return ids[start : start + n]


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], FIRST)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None
    return m.first_token_time - m.arrival_time


def build(prefix_tokens: int = 0, **overrides: Any) -> LLM:
    """An engine that has run one unrelated request of the measured shape (`prefix_tokens` + a
    question, sharing nothing with the measured prefix): a fresh engine's first forward over a long
    context pays one-time costs (allocator, thread pools, kernel set-up) that are not the tier's.
    Its tier writes are flushed before it is returned."""
    llm = LLM(model=MODEL, **overrides)
    llm.generate([text_ids(llm, prefix_tokens + QUESTION_TOKENS, seed=999)], FIRST)
    if llm.engine.tiers is not None:
        llm.engine.tiers.tiers.flush()
    return llm


def loads(llm: LLM, tier: str) -> int:
    return next(t.loads for t in llm.engine.stats().tiers if t.tier == tier)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.prefix_tokens
    probe = build(n, enable_prefix_caching=False)
    prefix = text_ids(probe, args.prefix_tokens, seed=1)
    questions = [text_ids(probe, QUESTION_TOKENS, seed=100 + i) for i in range(args.trials + 1)]
    rows: dict[str, list[float]] = {}

    rows["compute"] = [ttft(probe, prefix + q) for q in questions[1:]]
    del probe  # no tier: nothing holds it

    ram = build(n)
    ram.warm(prefix)
    ttft(ram, prefix + questions[0])
    rows["RAM hit"] = [ttft(ram, prefix + q) for q in questions[1:]]
    hot_bytes_per_token = ram.engine.info.bytes_per_token
    del ram

    disk_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-disk-"))
    try:
        first = build(0, kv_disk_dir=str(disk_dir))
        first.warm(prefix)
        first.engine.close()
        del first
        rows["disk after restart"] = []
        for q in questions[1:]:
            llm = build(n, kv_disk_dir=str(disk_dir))
            before = loads(llm, "disk")
            rows["disk after restart"].append(ttft(llm, prefix + q))
            assert loads(llm, "disk") - before == n // 128, "the prefix did not come from disk"
            llm.engine.close()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)

    with RedisServer() as server:
        first = build(0, kv_redis_url=server.url)
        first.warm(prefix)
        first.engine.close()
        del first
        rows["Redis hit"] = []
        for q in questions[1:]:
            llm = build(n, kv_redis_url=server.url)
            before = loads(llm, "redis")
            rows["Redis hit"].append(ttft(llm, prefix + q))
            assert loads(llm, "redis") - before == n // 128, "the prefix did not come from Redis"
            llm.engine.close()

    cold_rows, cold = cold_tier(args, prefix, questions)
    rows["cold tier (turbo3) promote"] = cold_rows
    cold["hot_bytes_per_token"] = hot_bytes_per_token
    return {"ttft_s": rows, "cold": cold}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cold_tier(
    args: argparse.Namespace, prefix: list[int], questions: list[list[int]]
) -> tuple[list[float], dict[str, Any]]:
    llm = build(len(prefix), kv_cold_bytes=args.cold_bytes)
    tiers = llm.engine.tiers
    assert tiers is not None and tiers.tiers.cold is not None
    times = []
    memory: dict[str, int] = {}
    for i, q in enumerate(questions[1:]):
        llm.warm(prefix, pin=False)
        if i == 0:  # what demotion frees: the pool's blocks; what it costs: the cold area's bytes
            memory = {"free_blocks_before": llm.engine.pool.num_free_blocks, "rss_before": rss_bytes()}
        demoted = tiers.tiers.demote_idle(time.monotonic() + 1)
        tiers.tiers.flush()
        if i == 0:
            memory.update(
                demoted_chunks=demoted,
                free_blocks_after=llm.engine.pool.num_free_blocks,
                rss_after=rss_bytes(),
                cold_used_bytes=tiers.tiers.cold.stats().used_bytes,
                block_bytes=int(llm.engine.info.bytes_per_token * llm.engine.info.block_size),
            )
        times.append(ttft(llm, prefix + q))
    stats = tiers.tiers.cold.stats()
    llm.engine.close()  # its tier threads hold the engine (and its pool) until closed
    return times, {
        "codec": stats.codec,
        "tokens_per_byte_ratio": stats.tokens_per_byte_ratio,
        "cold_bytes_per_token": stats.cold_bytes_per_token,
        "memory": memory,
        **agreement(args, prefix),
    }


def agreement(args: argparse.Namespace, prefix: list[int]) -> dict[str, Any]:
    """Greedy continuations from exact KV (an engine without a cold area) and after the prefix was
    demoted once and promoted (a fresh engine per prompt: a promoted chunk demoted again would be
    encoded twice)."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    hot_engine = LLM(model=MODEL)
    same, first, equal_share = [], [], []
    for i in range(args.agree_prompts):
        prompt = prefix + text_ids(hot_engine, QUESTION_TOKENS, seed=500 + i)
        hot = hot_engine.generate([prompt], params)[0].token_ids
        llm = LLM(model=MODEL, kv_cold_bytes=args.cold_bytes)
        assert llm.engine.tiers is not None
        llm.warm(prefix, pin=False)
        llm.engine.tiers.tiers.demote_idle(time.monotonic() + 1)
        llm.engine.tiers.tiers.flush()
        promoted = llm.generate([prompt], params)[0].token_ids
        assert loads(llm, "cold") == len(prefix) // 128
        llm.engine.close()
        same.append(hot == promoted)
        first.append(hot[0] == promoted[0])
        equal = next((j for j, (a, b) in enumerate(zip(hot, promoted, strict=True)) if a != b), len(hot))
        equal_share.append(equal / len(hot))
    return {
        "identical_continuations": sum(same) / len(same),
        "first_token_agreement": sum(first) / len(first),
        "mean_equal_share_before_first_difference": statistics.mean(equal_share),
        "num_prompts": len(same),
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = result["ttft_s"]
    ram = statistics.median(rows["RAM hit"])
    lines = [
        START,
        f"Measured by `python scripts/bench_tiers.py --prefix-tokens {args.prefix_tokens} --trials "
        f"{args.trials}` on {describe()}; model {MODEL}, dtype {result['dtype']}, codec {result['codec']}.",
        "",
        f"Time to first token of a {args.prefix_tokens}-token prefix + {QUESTION_TOKENS}-token question "
        f"(median of {args.trials}; ratio to a RAM hit):",
        "",
        "| prefix KV from | TTFT (ms) | x RAM hit |",
        "|---|---:|---:|",
    ]
    for name, values in rows.items():
        med = statistics.median(values)
        lines.append(f"| {name} | {med * 1e3:.1f} | {med / ram:.2f} |")
    cold = result["cold"]
    mem = cold["memory"]
    lines += [
        "",
        f"Cold tier ({cold['codec']}): {cold['cold_bytes_per_token']:.0f} bytes per token against the hot "
        f"pool's {cold['hot_bytes_per_token']:.0f}: **{cold['tokens_per_byte_ratio']:.2f}x** the tokens per "
        f"byte. Greedy agreement with the hot pool over {cold['num_prompts']} prompts (the prefix + a "
        f"different question each): the first token agrees for {cold['first_token_agreement'] * 100:.0f} %; "
        f"32-token continuations are identical for {cold['identical_continuations'] * 100:.0f} %, and on "
        f"average {cold['mean_equal_share_before_first_difference'] * 100:.0f} % of their tokens come before "
        "the first difference.",
        "",
        f"Demoting {mem['demoted_chunks']} idle chunks (the prefix and the warm-up request's) freed "
        f"{mem['free_blocks_after'] - mem['free_blocks_before']} blocks, "
        f"{(mem['free_blocks_after'] - mem['free_blocks_before']) * mem['block_bytes'] / 1e6:.1f} MB of the hot "
        f"pool, for other work; the cold area grew by {mem['cold_used_bytes'] / 1e6:.1f} MB and the "
        f"process's resident memory by {(mem['rss_after'] - mem['rss_before']) / 1e6:.1f} MB (the hot pool is "
        "allocated once, so its freed blocks are reused, not returned to the OS).",
        "",
        "![TTFT by tier](img/tiers_ttft.png)",
        "",
        END,
    ]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["ttft_s"]
    names = list(rows)
    meds = [statistics.median(rows[n]) * 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(names[::-1], meds[::-1], color="#4477aa")
    for y, value in enumerate(meds[::-1]):
        ax.text(value, y, f" {value:.0f} ms", va="center", fontsize=8)
    ax.set_xlabel("time to first token (ms), median")
    ax.set_title(f"{MODEL}: where a 2k-token prefix's KV comes from", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--agree-prompts", type=int, default=8)
    parser.add_argument("--cold-bytes", type=int, default=500_000_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/tiers.md alone")
    args = parser.parse_args()
    print(describe())
    result = measure(args)
    info = build(0, enable_prefix_caching=False).engine.info
    result.update(
        dtype=info.dtype, codec=info.kv_codec, machine=describe(), torch_threads=torch.get_num_threads()
    )
    lines = report(result, args)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not args.no_docs:
        plot(result, ROOT / "docs" / "img" / "tiers_ttft.png")
        page = ROOT / "docs" / "tiers.md"
        text = page.read_text()
        if START not in text:
            text += f"\n## Measured: TTFT by tier\n\n{START}\n{END}\n"
        head, rest = text.split(START, 1)
        page.write_text(head + "\n".join(lines) + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
