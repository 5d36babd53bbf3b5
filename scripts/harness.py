"""What the benchmark scripts share (issue 65: one harness, no script importing another): so far the
report helpers of the serving comparisons (bench_compare.py, bench_vllm_report.py)."""

from __future__ import annotations


def fmt(x: float | None, digits: int = 3) -> str:
    """A table cell: the number to `digits` places, "-" for none."""
    return "-" if x is None else f"{x:.{digits}f}"


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
