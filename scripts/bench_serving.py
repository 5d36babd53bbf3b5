"""Benchmark one OpenAI-compatible server on one workload: TTFT, ITL, end-to-end, tokens/s, errors.

Workloads are built from Python's bundled documentation (`pydoc_data.topics`) with fixed seeds, so
every system gets the same requests. Requests are streamed with the real OpenAI client and timed
from the moment each is sent; TTFT is the first chunk that carries text. The workloads, the client and
the runs are the harness's (harness/serving.py); this is their command line.

    .venv/bin/python scripts/bench_serving.py --system kvserve --workload shared [--quick]
    .venv/bin/python scripts/bench_serving.py --base-url http://127.0.0.1:8000/v1 --workload rag
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.serving import QUICK, WORKLOADS, Size, bench_system, build_workload, load_tokenizer, run_workload  # noqa: E402


def print_table(result: dict) -> None:
    print(f"{result['system']} / {result['workload']}")
    if "unavailable" in result:
        print("  unavailable:", result["unavailable"].splitlines()[-1:])
        return
    print(f"  peak RSS {result.get('peak_rss_bytes', 0) / 2**20:.0f} MiB")
    print("  phase  reqs err resent  ttft_p50  ttft_p95  itl_p50  e2e_p50  out_tok/s")
    for ph in result["phases"]:
        s = ph["summary"]
        cells = [s["ttft_p50_s"], s["ttft_p95_s"], s["itl_p50_s"], s["e2e_p50_s"]]
        cells_txt = "".join(f"{x:9.3f}" if x is not None else "        -" for x in cells)
        tps = s["output_tok_per_s"] or 0.0
        resent = s.get("resends", 0)
        print(f"  {ph['phase']:5} {s['requests']:5} {s['errors']:3} {resent:6} {cells_txt} {tps:10.1f}")


def main() -> None:
    from peers.launch import exit_on_sigterm

    exit_on_sigterm()
    p = argparse.ArgumentParser(description="Benchmark one server on one workload.")
    p.add_argument("--system", default="kvserve", help="a name from scripts/peers/launch.py")
    p.add_argument("--base-url", help="benchmark an already running server instead")
    p.add_argument("--workload", choices=WORKLOADS, default="shared")
    p.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--out", type=Path, help="write the result JSON here")
    args = p.parse_args()
    size = QUICK if args.quick else Size()
    if args.base_url:
        tokenizer = load_tokenizer()
        phases = build_workload(args.workload, tokenizer, size)
        result = {"system": args.base_url, "workload": args.workload}
        result["phases"] = asyncio.run(run_workload(args.base_url, phases, size, 0.0, tokenizer))
    else:
        result = bench_system(args.system, args.workload, size, args.port, Path("out/bench/logs"))
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
