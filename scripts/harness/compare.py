"""Serving comparisons: every (workload, system) pair run into one results file, in an order rotated
per workload (or, interleaved, all the systems of a workload at once taking turns), resumable, with
each system's greedy agreement with the baseline's outputs (scripts/bench_compare.py,
scripts/bench_weights.py --part peers)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from harness.machine import machine
from harness.serving import WORKLOADS, Size, agreement, bench_interleaved, bench_system

BASELINE = "hf"  # the system whose outputs are the reference for agreement (no reuse, greedy)


def rotated(names: list[str], k: int) -> list[str]:
    """names rotated left by k, with the baseline kept first (its outputs are the reference)."""
    rest = [n for n in names if n != BASELINE]
    k %= max(len(rest), 1)
    return ([BASELINE] if BASELINE in names else []) + rest[k:] + rest[:k]


def add_agreement(results: list[dict]) -> None:
    """Adds result["agreement"] vs the baseline's greedy outputs on the same workload."""
    outputs = {}
    for r in results:
        outputs[(r["system"], r["workload"])] = {
            rec["id"]: rec["token_ids"]
            for ph in r.get("phases", [])
            for rec in ph["records"]
            if rec["error"] is None
        }
    for r in results:
        ref = outputs.get((BASELINE, r["workload"]))
        if ref is not None and "phases" in r:
            r["agreement"] = agreement(outputs[(r["system"], r["workload"])], ref)


def agreement_rates(data: dict) -> dict[str, tuple[int, float]]:
    """system -> (compared requests, exact-match rate) against the baseline, all workloads pooled."""
    pooled: dict[str, tuple[int, float]] = {}
    for r in data["results"]:
        a = r.get("agreement") or {}
        if a.get("n") and r["system"] != BASELINE:
            n, e = pooled.get(r["system"], (0, 0.0))
            pooled[r["system"]] = (n + a["n"], e + a["exact"] * a["n"])
    return {s: (n, e / n) for s, (n, e) in pooled.items()}


def run_all(
    systems: list[str], workloads: list[str], size: Size, out: Path, resume: bool, interleave: bool = False
):
    """Runs every (workload, system) pair not already in `out` (with resume), saving after each; with
    `interleave`, all the systems of a workload at once, taking turns (harness.serving.bench_interleaved)."""
    from peers.launch import systems as system_specs

    data = json.loads(out.read_text()) if resume and out.exists() else {"results": []}
    meta = data.get("meta") or {
        "machine": machine(),
        "commands": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if "command" in meta:  # written by a first version of bench_compare.py
        meta["commands"] = [meta.pop("command")]
    meta["commands"].append(" ".join(sys.argv))
    meta["size"] = vars(size)
    results = data["results"]
    done = {(r["system"], r["workload"]) for r in results}
    for workload in workloads:
        k = WORKLOADS.index(workload)
        specs = system_specs(workload)
        if interleave:
            names = [
                n
                for n in systems
                if (n, workload) not in done
                and not (specs[n].workloads and workload not in specs[n].workloads)
            ]
            if not names:
                continue
            t0, load = time.monotonic(), os.getloadavg()[0]
            runs = bench_interleaved(names, workload, size, 18400 + 10 * k, out.parent / "logs")
            for r in runs:
                r["run_wall_s"], r["loadavg_1m_before"] = time.monotonic() - t0, load
            _keep(runs, "interleaved", results, meta, out)
            continue
        for i, name in enumerate(rotated(systems, k)):
            only = specs[name].workloads
            if (name, workload) in done or (only and workload not in only):
                continue
            t0 = time.monotonic()
            load = os.getloadavg()[0]
            r = bench_system(name, workload, size, 18400 + 10 * k + i, out.parent / "logs")
            r["run_wall_s"] = time.monotonic() - t0
            r["loadavg_1m_before"] = load
            _keep([r], f"{r['run_wall_s']:6.0f} s", results, meta, out)
    return {"meta": meta, "results": results}


def _keep(runs: list[dict], how: str, results: list[dict], meta: dict, out: Path) -> None:
    """Add a workload's runs to the results, say how each went, and rewrite `out` (so an interrupted
    run resumes from there)."""
    for r in runs:
        results.append(r)
        status = r.get("unavailable", "ok").splitlines()[-1][:120]
        print(f"[{time.strftime('%H:%M:%S')}] {r['workload']:9} {r['system']:15} {how}  {status}", flush=True)
    add_agreement(results)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
