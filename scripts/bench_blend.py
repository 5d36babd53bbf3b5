"""Position-independent reuse on a RAG workload: speed and quality of each repair strategy.

About 20 documents of 300-600 tokens of real text (Python's bundled pydoc topics) are warmed alone.
Each prompt is a short header, 3-5 of the documents in a random order, and a question. For every
strategy the same prompts run on one engine (the documents cached), against a full prefill on an
engine with caching off:
  TTFT (median), fraction of prompt tokens reused, compute fraction (token-layers computed / a full
  prefill's), first-token KL(full || strategy) in nats, top-1 agreement of the first token, and greedy
  agreement over 32 tokens (share of positions equal to the full prefill's output).
A second table compares fixed and content-defined chunking by the share of document tokens found.

    python scripts/bench_blend.py [--prompts 8] [--json out.json] [--plot docs/img/blend.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics

import torch

from kvserve import LLM, SamplingParams
from kvserve.request import RequestOutput, ReuseOptions

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
}
QUESTIONS = [
    "Question: which statement do these sections describe first, and how is it used?",
    "Question: summarise the rules above in one sentence.",
    "Question: what happens when an exception is raised here?",
    "Question: list two keywords mentioned in the documents.",
]


def make_documents(llm: LLM, num_docs: int, rng: random.Random) -> list[list[int]]:
    from pydoc_data.topics import topics

    docs = []
    for key in rng.sample(sorted(topics), num_docs):
        ids = llm.tokenizer.encode(topics[key])
        length = rng.randint(300, 600)
        if len(ids) >= 300:
            docs.append(ids[:length])
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
    engine.logits_sink = {}
    try:
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), reuse=opts
        )
        return out, engine.logits_sink[out.request_id][0]
    finally:
        engine.logits_sink = None


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pieces", default="content")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--replot", default="", help="only redraw --plot from this --json file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["table"], args.plot)
        return

    rng = random.Random(0)
    llm = LLM(model=args.model, pieces=args.pieces, max_cache_bytes=2_000_000_000)
    cold = LLM(model=args.model, enable_prefix_caching=False, max_cache_bytes=500_000_000)
    docs = make_documents(llm, args.docs, rng)
    prompts = make_prompts(llm, docs, args.prompts, rng)
    for d in docs:
        llm.warm(d)
    run(cold, prompts[0][:64], None, 1)  # warm-up of the code paths, not of any KV
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in STRATEGIES}

    def add(name: str, key: str, value: float) -> None:
        rows[name].setdefault(key, []).append(value)

    for prompt in prompts:  # strategies interleaved per prompt
        ref, ref_logits = run(cold, prompt, None, args.max_tokens)
        add("full prefill", "ttft", ref.metrics.ttft_s or 0.0)
        for name, opts in STRATEGIES.items():
            if opts is None:
                continue
            out, logits = run(llm, prompt, opts, args.max_tokens)
            add(name, "ttft", out.metrics.ttft_s or 0.0)
            add(name, "reused", out.num_approx_cached_tokens / len(prompt))
            add(name, "compute", out.compute_fraction if out.compute_fraction is not None else 1.0)
            add(name, "kl", kl(ref_logits, logits))
            add(name, "top1", float(int(logits.argmax()) == int(ref_logits.argmax())))
            add(name, "agree", sum(a == b for a, b in zip(out.token_ids, ref.token_ids)) / len(ref.token_ids))

    mean = statistics.fmean
    full_ttft = statistics.median(rows["full prefill"]["ttft"])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    avg_len = mean(len(p) for p in prompts)
    print(
        f"# bench_blend: {args.model}, {len(docs)} docs, {len(prompts)} prompts of {avg_len:.0f} tokens on average, "
        f"pieces={args.pieces}; {machine}"
    )
    print(
        "| strategy | TTFT ms (median) | speed-up vs full | reused | compute fraction | first-token KL | top-1 agree | greedy agree (32) |"
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

    rates = piece_hit_rates(args.model, docs, prompts)
    print("\n| pieces | share of prompt tokens reused (strategy none) |\n|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {v:.3f} |")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "table": table, "piece_hit_rates": rates, "raw": rows}, f, indent=1
            )
    if args.plot:
        plot(table, args.plot)


def plot(table: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, e in table.items():
        if name == "full prefill":
            continue
        a.scatter(e["speedup"], max(e["kl"], 1e-5), s=40)
        a.annotate(
            name, (e["speedup"], max(e["kl"], 1e-5)), fontsize=8, xytext=(4, 3), textcoords="offset points"
        )
    a.set_yscale("log")
    a.set_xlabel("TTFT speed-up vs full prefill (x)")
    a.set_ylabel("first-token KL to full prefill (nats, log)")
    a.set_title("Quality vs speed per repair strategy")
    a.grid(alpha=0.3)
    names = list(table)
    b.barh(names, [table[n]["compute"] for n in names], color="tab:blue", label="compute fraction")
    b.barh(
        names,
        [table[n]["agree"] for n in names],
        height=0.3,
        color="tab:orange",
        label="greedy agreement (32)",
    )
    b.set_xlim(0, 1.05)
    b.set_title("Compute spent and greedy agreement")
    b.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
