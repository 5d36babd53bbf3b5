"""Position-independent reuse on RAG workloads: speed and quality of each repair strategy.

Suites (--suite warmed,zipf,itl or all):
  warmed  the table below, plus the online audit of every served prompt next to the KL measured
          here against a cache-off engine (the audit must reproduce it)
  zipf    documents never warmed, drawn by Zipf popularity (40 documents, 200 prompts, s = 1.1):
          exact-only reuse vs `--reuse any` with the server's defaults (cost-aware choice), TTFT p50
          and greedy agreement
  itl     inter-token latency of 4 decoding requests while a ~3,000-token RAG prompt is repaired,
          against the same 4 alone and against an exact-only prefill of the same prompt, per
          --max-num-batched-tokens

About 20 documents of 300-600 tokens of real text (Python's bundled pydoc topics) are warmed alone.
Each prompt is a short header, 3-5 of the documents in a random order, and a question. For every
strategy the same prompts run on one engine (the documents cached), against a full prefill on an
engine with caching off:
  TTFT (median), fraction of prompt tokens reused, compute fraction (token-layers computed / a full
  prefill's), first-token KL(full || strategy) in nats, top-1 agreement of the first token, and greedy
  agreement over 32 tokens (share of positions equal to the full prefill's output).
A second table compares fixed and content-defined chunking by the share of document tokens found.

    python scripts/bench_blend.py [--suite all] [--prompts 8] [--json out.json] [--plot docs/img/blend.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.request import RequestOutput, ReuseOptions  # noqa: E402

STRATEGIES: dict[str, ReuseOptions | None] = {
    "full prefill": None,
    "none": ReuseOptions(reuse="any", recompute_strategy="none"),
    "selective R=8": ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=8),
    "selective R=16": ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=16),
    "selective R=32": ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=32),
    "cacheblend 0.05": ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.05),
    "cacheblend 0.10": ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.10),
    "cacheblend 0.15": ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.15),
    "cacheblend 0.30": ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.30),
    "query R=4 0.45": ReuseOptions(
        reuse="any", recompute_strategy="query", recompute_tokens=4, recompute_ratio=0.45
    ),
    # selection study: the check layer (0 = unranked: moved and fresh K agree there), seam-aware
    "cacheblend 0.15 check 0": ReuseOptions(
        reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.15, blend_check_layer=0
    ),
    "cacheblend 0.15 check 3": ReuseOptions(
        reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.15, blend_check_layer=3
    ),
    "cacheblend 0.15 seams 8": ReuseOptions(
        reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.15, blend_seam_tokens=8
    ),
    "cacheblend 0.05 seams 8": ReuseOptions(
        reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.05, blend_seam_tokens=8
    ),
}
QUESTIONS = [
    "Question: which statement do these sections describe first, and how is it used?",
    "Question: summarise the rules above in one sentence.",
    "Question: what happens when an exception is raised here?",
    "Question: list two keywords mentioned in the documents.",
]


def make_documents(llm: LLM, num_docs: int, rng: random.Random, fill: bool = False) -> list[list[int]]:
    """Documents of 300-600 tokens from `num_docs` random pydoc topics (the shorter topics are left
    out, so fewer come back), or with `fill` from as many topics as it takes to get `num_docs`."""
    from pydoc_data.topics import topics

    docs = []
    keys = sorted(topics)
    for key in rng.sample(keys, len(keys) if fill else num_docs):
        ids = llm.tokenizer.encode(topics[key])
        length = rng.randint(300, 600)
        if len(ids) >= 300:
            docs.append(ids[:length])
        if len(docs) == num_docs:
            break
    return docs


def make_prompts(llm: LLM, docs: list[list[int]], n: int, rng: random.Random) -> list[list[int]]:
    header = llm.tokenizer.encode("Answer using the documents below.\n\n")
    prompts = []
    for i in range(n):
        chosen = rng.sample(range(len(docs)), rng.randint(3, 5))
        body = [t for i in chosen for t in docs[i] + llm.tokenizer.encode("\n\n")]
        prompts.append(header + body + llm.tokenizer.encode(QUESTIONS[i % len(QUESTIONS)]))
    return prompts


def run(
    llm: LLM, prompt: list[int], opts: ReuseOptions | None, max_tokens: int
) -> tuple[RequestOutput, torch.Tensor]:
    engine = llm.engine
    engine.update.logits_sink = {}
    try:
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), reuse=opts
        )
        return out, engine.update.logits_sink[out.request_id][0]
    finally:
        engine.update.logits_sink = None


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    logp, logq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((logp.exp() * (logp - logq)).sum())


def piece_hit_rates(model: str, docs: list[list[int]], prompts: list[list[int]]) -> dict[str, float]:
    rates = {}
    for pieces in ("fixed", "content"):
        llm = LLM(model=model, pieces=pieces, max_cache_bytes=2_000_000_000)
        for d in docs:
            llm.warm(d)
        reused = total = 0
        for p in prompts:
            out, _ = run(llm, p, ReuseOptions(reuse="any", recompute_strategy="none"), 1)
            reused += out.num_approx_cached_tokens
            total += len(p)
        rates[pieces] = reused / total
        del llm
    return rates


def machine_line() -> str:
    from harness.machine import cpu_name

    return (
        f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def warmed_suite(args: argparse.Namespace, results: dict) -> None:
    """Documents warmed alone; every strategy on the same prompts (interleaved per prompt) against a
    full prefill; every served prompt audited, and the audits compared with the offline KL."""
    rng = random.Random(0)
    # every strategy's plan is taken (reuse_min_saving < 0): this suite measures the strategies
    llm = LLM(model=args.model, pieces=args.pieces, max_cache_bytes=2_000_000_000, reuse_min_saving=-10.0)
    cold = LLM(model=args.model, enable_prefix_caching=False, max_cache_bytes=500_000_000)
    docs = make_documents(llm, args.docs, rng)
    prompts = make_prompts(llm, docs, args.prompts, rng)
    for d in docs:
        llm.warm(d)
    run(cold, prompts[0][:64], None, 1)  # warm-up of the code paths, not of any KV
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in STRATEGIES}
    offline: dict[str, tuple[str, float]] = {}  # request id -> (strategy, KL measured here)

    def add(name: str, key: str, value: float) -> None:
        rows[name].setdefault(key, []).append(value)

    for prompt in prompts:  # strategies interleaved per prompt
        ref, ref_logits = run(cold, prompt, None, args.max_tokens)
        add("full prefill", "ttft", ref.metrics.ttft_s or 0.0)
        for name, opts in STRATEGIES.items():
            if opts is None:
                continue
            # audited: the engine keeps the served logits; the recomputes run after the last prompt
            out, logits = run(llm, prompt, dataclasses.replace(opts, audit=True), args.max_tokens)
            add(name, "ttft", out.metrics.ttft_s or 0.0)
            add(name, "reused", out.num_approx_cached_tokens / len(prompt))
            add(name, "compute", out.compute_fraction if out.compute_fraction is not None else 1.0)
            add(name, "kl", kl(ref_logits, logits))
            add(name, "top1", float(int(logits.argmax()) == int(ref_logits.argmax())))
            add(name, "agree", sum(a == b for a, b in zip(out.token_ids, ref.token_ids)) / len(ref.token_ids))
            offline[out.request_id] = (name, rows[name]["kl"][-1])
    llm.engine.run_background()  # the audits' full recomputes (nothing else runs now)

    mean = statistics.fmean
    full_ttft = statistics.median(rows["full prefill"]["ttft"])
    avg_len = mean(len(p) for p in prompts)
    print(
        f"\n## warmed: {args.model}, {len(docs)} docs warmed alone, {len(prompts)} prompts of {avg_len:.0f} "
        f"tokens on average, pieces={args.pieces}; {machine_line()}\n"
    )
    print(
        "| strategy | TTFT ms (median) | speed-up vs full | reused | compute fraction | first-token KL "
        f"| top-1 agree | greedy agree ({args.max_tokens}) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    table = {}
    for name, r in rows.items():
        ttft = statistics.median(r["ttft"])
        entry = {"ttft_ms": ttft * 1000, "speedup": full_ttft / ttft}
        if name == "full prefill":
            entry.update(reused=0.0, compute=1.0, kl=0.0, top1=1.0, agree=1.0)
        else:
            entry.update(
                reused=mean(r["reused"]),
                compute=mean(r["compute"]),
                kl=mean(r["kl"]),
                top1=mean(r["top1"]),
                agree=mean(r["agree"]),
            )
        table[name] = entry
        print(
            f"| {name} | {entry['ttft_ms']:.0f} | {entry['speedup']:.2f}x | {entry['reused']:.2f} | "
            f"{entry['compute']:.3f} | {entry['kl']:.4f} | {entry['top1']:.2f} | {entry['agree']:.2f} |"
        )
    audit = audit_table(llm, offline)
    rates = piece_hit_rates(args.model, docs, prompts)
    print("\n| pieces | share of prompt tokens reused (strategy none) |\n|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {v:.3f} |")
    results["warmed"] = {"table": table, "audit": audit, "piece_hit_rates": rates, "raw": rows}
    if args.plot:
        plot(table, args.plot)


def audit_table(llm: LLM, offline: dict[str, tuple[str, float]]) -> dict[str, dict[str, float]]:
    """The online audit's KL per strategy next to the KL this script measured against a cache-off
    engine for the same requests."""
    audited = {r.request_id: r.first_kl for r in llm.engine.reuse.auditor.results}
    print("\n| strategy | audited | audit KL p50 | p95 | max | offline KL p50 | p95 | max | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {}
    for name in STRATEGIES:
        pairs = [(audited[rid], off) for rid, (n, off) in offline.items() if n == name and rid in audited]
        if not pairs:
            continue
        a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
        o = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
        q = torch.tensor([0.5, 0.95], dtype=torch.float64)
        (ap50, ap95), (op50, op95) = torch.quantile(a, q).tolist(), torch.quantile(o, q).tolist()
        diff = float((a - o).abs().max())
        out[name] = dict(n=len(pairs), audit_p50=ap50, audit_p95=ap95, audit_max=float(a.max()),
                         offline_p50=op50, offline_p95=op95, offline_max=float(o.max()), max_abs_diff=diff)  # fmt: skip
        print(
            f"| {name} | {len(pairs)} | {ap50:.4f} | {ap95:.4f} | {float(a.max()):.4f} | {op50:.4f} | "
            f"{op95:.4f} | {float(o.max()):.4f} | {diff:.1e} |"
        )
    return out


def zipf_prompts(llm: LLM, docs: list[list[int]], n: int, s: float, rng: random.Random) -> list[list[int]]:
    """Prompts of 3-5 documents drawn by Zipf popularity (weight 1 / rank^s), in random order."""
    header = llm.tokenizer.encode("Answer using the documents below.\n\n")
    weights = [1.0 / (rank + 1) ** s for rank in range(len(docs))]
    prompts = []
    for i in range(n):
        chosen: list[int] = []
        while len(chosen) < rng.randint(3, 5):
            d = rng.choices(range(len(docs)), weights)[0]
            if d not in chosen:
                chosen.append(d)
        body = [t for d in chosen for t in docs[d] + llm.tokenizer.encode("\n\n")]
        prompts.append(header + body + llm.tokenizer.encode(QUESTIONS[i % len(QUESTIONS)]))
    return prompts


def zipf_suite(args: argparse.Namespace, results: dict) -> None:
    """Documents never warmed: each is first met inside a request. Exact-only reuse and `--reuse any`
    under each of --zipf-strategies (cost-aware choice) on the same prompts, in turns per prompt."""
    rng = random.Random(1)
    engines = {"exact-only": LLM(model=args.model, pieces=args.pieces, max_cache_bytes=2_000_000_000)}
    for name in args.zipf_strategies.split(","):
        opts = STRATEGIES[name]
        assert opts is not None, "full prefill is the exact-only engine"
        knobs = {
            k: v for k, v in dataclasses.asdict(opts).items() if k.startswith("recompute_") and v is not None
        }
        engines[f"reuse any ({name})"] = LLM(
            model=args.model, pieces=args.pieces, max_cache_bytes=2_000_000_000, reuse="any", **knobs
        )
    docs = make_documents(engines["exact-only"], args.zipf_docs, rng, fill=True)
    prompts = zipf_prompts(engines["exact-only"], docs, args.zipf_prompts, args.zipf_s, rng)
    for llm in engines.values():
        run(llm, prompts[0][-16:], None, 1)  # warm-up of the code paths
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    names = list(engines)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # who goes first rotates
            out, _ = run(engines[name], prompt, None, args.zipf_max_tokens)
            ttft[name].append(out.metrics.ttft_s or 0.0)
            outputs[name].append(out.token_ids)
    exact = statistics.median(ttft["exact-only"])
    avg_len = statistics.fmean(len(p) for p in prompts)
    print(
        f"\n## zipf: {len(prompts)} prompts of {avg_len:.0f} tokens on average over {len(docs)} documents "
        f"(Zipf s={args.zipf_s}), none warmed; {machine_line()}\n"
    )
    print(
        f"| engine | TTFT p50 ms | TTFT mean ms | vs exact-only (p50) | greedy agreement ({args.zipf_max_tokens} "
        "tokens) | identical outputs | plans |\n|---|---|---|---|---|---|---|"
    )
    rows: dict[str, dict] = {}
    for name, llm in engines.items():
        p50 = statistics.median(ttft[name])
        pairs = list(zip(outputs[name], outputs["exact-only"]))
        agree = statistics.fmean(sum(a == b for a, b in zip(x, y)) / len(y) for x, y in pairs)
        same = statistics.fmean(float(x == y) for x, y in pairs)
        plans = llm.stats().content_reuse.plans if name != "exact-only" else {}
        rows[name] = {"ttft": ttft[name], "speedup_p50": exact / p50, "agreement": agree, "identical": same,
                      "plans": plans}  # fmt: skip
        print(
            f"| {name} | {p50 * 1000:.0f} | {statistics.fmean(ttft[name]) * 1000:.0f} | {exact / p50:.2f}x | "
            f"{agree:.2f} | {same:.2f} | {plans or '-'} |"
        )
    results["zipf"] = rows


def itl_suite(args: argparse.Namespace, results: dict) -> None:
    """ITL of 4 decoding requests while a long RAG prompt is repaired, against the same 4 alone."""
    from kvserve.request import Request

    table = []
    configs = [
        ("budget 2048", {}),
        ("budget 2048, --decode-slowdown-limit 1.5", {"decode_slowdown_limit": 1.5}),
        ("budget 2048, --decode-slowdown-limit 1.25", {"decode_slowdown_limit": 1.25}),
        ("budget 256", {"max_num_batched_tokens": 256}),
    ]
    for label, overrides in configs:
        rng = random.Random(2)
        llm = LLM(model=args.model, pieces=args.pieces, max_cache_bytes=2_000_000_000, **overrides)
        docs = []
        for d in make_documents(llm, 20, rng):  # about 3,000 tokens of documents
            if sum(map(len, docs)) < 2950:
                docs.append(d)
        for d in docs:
            llm.warm(d)
        header = llm.tokenizer.encode("Answer using the documents below.\n\n")
        order = rng.sample(range(len(docs)), len(docs))
        rag = header + [t for i in order for t in docs[i]] + llm.tokenizer.encode(QUESTIONS[1])
        chats = [llm.tokenizer.encode(QUESTIONS[i % 4] + f" ({i})") * 8 for i in range(4)]
        measure_itl(llm, chats, None, None, Request)  # warm-up: code paths and the cost model's fit
        for case, reuse in (("alone", None), ("repair (reuse any)", "any"), ("exact prefill", "prefix")):
            itl, rag_ttft = measure_itl(llm, chats, rag if reuse else None, reuse, Request)
            row = {
                "config": label, "case": case, "itl_p50_ms": 1000 * statistics.median(itl),
                "itl_p99_ms": 1000 * float(torch.quantile(torch.tensor(itl), 0.99)), "rag_ttft_ms": 1000 * rag_ttft,
                "rag_tokens": len(rag), "samples": len(itl),
            }  # fmt: skip
            table.append(row)
    print(f"\n## itl: 4 decoding requests, a RAG prompt of {len(rag)} tokens arrives; {machine_line()}\n")
    print("| config | case | decode ITL p50 ms | ITL p99 ms | p99 vs alone | gaps | RAG TTFT ms |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        alone = next(r for r in table if r["config"] == row["config"] and r["case"] == "alone")
        print(
            f"| {row['config']} | {row['case']} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | "
            f"{row['itl_p99_ms'] / alone['itl_p99_ms']:.2f}x | {row['samples']} | {row['rag_ttft_ms']:.0f} |"
        )
    results["itl"] = table


def measure_itl(llm: LLM, chats, rag, reuse, Request) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
    """Starts the 4 chats, lets them decode, then (with `rag`) adds the RAG request; returns the chats'
    inter-token gaps from then until the RAG request's first token (or for as many steps without it)
    and the RAG TTFT."""
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    tag = f"{reuse}-{time.monotonic_ns()}"
    for i, c in enumerate(chats):
        engine.add_request(Request(f"chat{i}-{tag}", c, params))
    last: dict[str, float] = {}
    gaps: list[float] = []

    def tokens_at(outs, now: float, record: bool) -> None:  # type: ignore[no-untyped-def]
        for o in outs:
            if o.request_id.startswith("chat") and o.new_token_ids:
                if record and o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now

    for _ in range(10):  # every chat is decoding
        tokens_at(engine.step(), time.perf_counter(), False)
    t0 = time.perf_counter()
    if rag is not None:
        opts = ReuseOptions(reuse=reuse)
        engine.add_request(
            Request(f"rag-{tag}", rag, SamplingParams(max_tokens=1, temperature=0), reuse=opts)
        )
    rag_ttft = 0.0
    steps = 0
    while not rag_ttft and (rag is not None or steps < 40):
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        tokens_at(outs, now, True)  # a gap that spans the arrival counts
        if any(o.request_id.startswith("rag") and o.finished for o in outs):
            rag_ttft = now - t0
    engine.abort_all("benchmark phase over")
    while engine.has_unfinished_requests():
        engine.step()
    return gaps, rag_ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="warmed", help="comma-separated: warmed, zipf, itl (or all)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pieces", default="content")
    ap.add_argument("--zipf-docs", type=int, default=40)
    ap.add_argument("--zipf-prompts", type=int, default=200)
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--zipf-max-tokens", type=int, default=16)
    ap.add_argument(
        "--zipf-strategies",
        default="selective R=16,query R=4 0.45",
        help="comma-separated repair strategies, each an engine beside exact-only",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--replot", default="", help="only redraw --plot from this --json file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["warmed"]["table"], args.plot)
        return
    suites = ["warmed", "zipf", "itl"] if args.suite == "all" else args.suite.split(",")
    results: dict = {"machine": machine_line()}
    for suite in suites:
        {"warmed": warmed_suite, "zipf": zipf_suite, "itl": itl_suite}[suite](args, results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def plot(table: dict[str, dict[str, float]], path: str) -> None:
    """Left: TTFT against greedy agreement per strategy (full prefill included); right: speed-up
    against first-token KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, e in table.items():
        a.scatter(e["ttft_ms"], e["agree"], s=40, color="tab:red" if name == "full prefill" else "tab:blue")
        a.annotate(name, (e["ttft_ms"], e["agree"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        if name == "full prefill":
            continue
        b.scatter(e["speedup"], max(e["kl"], 1e-5), s=40)
        b.annotate(
            name, (e["speedup"], max(e["kl"], 1e-5)), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    a.set_xlabel("TTFT, median (ms)")
    a.set_ylabel("greedy agreement with full prefill")
    a.set_title("TTFT against agreement per strategy")
    a.grid(alpha=0.3)
    b.set_yscale("log")
    b.set_xlabel("TTFT speed-up vs full prefill (x)")
    b.set_ylabel("first-token KL to full prefill (nats, log)")
    b.set_title("Quality against speed per strategy")
    b.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
