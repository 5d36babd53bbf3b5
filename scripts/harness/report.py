"""What the benchmarks' reports share: table cells, percentiles, per-phase summaries, the slimmed JSON
committed beside a page."""

from __future__ import annotations


def fmt(x: float | None, digits: int = 3) -> str:
    """A table cell: the number to `digits` places, "-" for none."""
    return "-" if x is None else f"{x:.{digits}f}"


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summaries(data: dict) -> dict:
    """A serving comparison's results (harness.compare.run_all) as (system, workload, phase) -> the
    phase's summary, for the runs that were available, with decode_tok_per_s = 1 / ITL p50 added."""
    out = {}
    for r in data["results"]:
        for ph in r.get("phases", []):
            summary = dict(ph["summary"])
            itl = summary.get("itl_p50_s")
            summary["decode_tok_per_s"] = 1.0 / itl if itl else None
            out[(r["system"], r["workload"], ph["phase"])] = summary
    return out


def slim(data: dict) -> dict:
    """The JSON committed beside the page: per-request timings, no output text."""
    keep = ("id", "ttft_s", "e2e_s", "itl_s", "num_output_tokens", "error")
    results = []
    for r in data["results"]:
        r = dict(r)
        r["phases"] = [
            {**p, "records": [{k: rec[k] for k in keep} for rec in p["records"]]} for p in r.get("phases", [])
        ]
        results.append(r)
    return {"meta": data["meta"], "results": results}
