"""Do grammar compiles stall the server? (issue 32.2)

Starts a kvserve server (tiny-random-llama: a fast model, so the stream's own steps are short) and:

  first   the first json_schema request after start-up (a small schema): its seconds, against the
          same request again (cached) and a new small schema. The llguidance tokenizer is built at
          start-up, so the first request should not wait for it (it took 0.4-0.9 s on this CPU).
  stall   a long completion streams; once it flows, --schemas distinct schemas of --properties
          required string properties each (2,000: ~400 KB, the issue's case) are POSTed at once
          (max_tokens 1) while /health is polled every 20 ms; then the same schemas again, now cached
          (only their bodies are parsed), as the control; before them, the stream alone for a second
          (quiet: the machine's own gaps) and as many plain small requests at once (small: what
          admitting that many requests costs the stream). Reported per round: the longest gap between the stream's
          chunks, the slowest /health, the requests' seconds. Target: gap <= 50 ms.

    python scripts/bench_grammar_compile.py [--properties 2000] [--schemas 5] [--rounds 3] [--json out.json]

The measurement itself is tests/e2e/test_grammar_compile.py::measure_stall (the test asserts it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from harness.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the measurement lives in tests/e2e

KINDS = ("quiet", "small", "compiling", "cached")


def first_request(base_url: str) -> dict[str, float]:
    def post(schema: dict[str, Any]) -> float:
        body = {
            "prompt": "x",
            "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        }
        t0 = time.perf_counter()
        httpx.post(base_url + "/v1/completions", json=body, timeout=60).raise_for_status()
        return time.perf_counter() - t0

    small = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    other = {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}
    return {"first_s": post(small), "cached_s": post(small), "new_small_s": post(other)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--properties", type=int, default=2000, help="required properties per schema")
    parser.add_argument("--schemas", type=int, default=5, help="distinct schemas compiled at once")
    parser.add_argument("--rounds", type=int, default=3, help="stall rounds (new schemas each)")
    parser.add_argument(
        "--client",
        choices=("isolated", "legacy", "both"),
        default="isolated",
        help="isolated: the stream read in its own process, the requests on one client made before the "
        "round; legacy: the stream read on a thread of the posting process, a new client per request "
        "(how it was first measured); both: alternate them, round by round",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    modes = {"isolated": [True], "legacy": [False], "both": [True, False]}[args.client]

    from tests.e2e.conftest import TINY_FLAGS, launch, stop
    from tests.e2e.test_grammar_compile import large_schema, measure_stall

    print(describe())
    server = launch(Path(tempfile.mkdtemp()), *TINY_FLAGS)
    try:
        first = first_request(server.base_url)
        rounds = []
        for r in range(args.rounds):
            for isolated in modes:
                salt = f"r{r}{'i' if isolated else 'l'}"
                schemas = [large_schema(f"{salt}s{i}", args.properties) for i in range(args.schemas)]
                m = measure_stall(server.base_url, schemas, isolated=isolated)
                rounds.append({"round": r, "client": "isolated" if isolated else "legacy", **m})
    finally:
        stop(server)
    size_kb = len(json.dumps(large_schema("r0s0", args.properties))) / 1000
    print(
        f"\nfirst json_schema request after start-up: {first['first_s'] * 1000:.0f} ms; the same again "
        f"(cached) {first['cached_s'] * 1000:.0f} ms; a new small schema {first['new_small_s'] * 1000:.0f} ms"
    )
    print(f"\n{args.schemas} distinct schemas of {args.properties} properties ({size_kb:.0f} KB) at once:")
    print("| round | client | grammars | longest stream gap ms | slowest /health ms | requests s (min-max) |")
    print("|---|---|---|---|---|---|")
    for m in rounds:
        for kind in KINDS:
            x = m[kind]
            seconds = f"{min(x['request_s']):.2f}-{max(x['request_s']):.2f}" if x["request_s"] else "-"
            print(
                f"| {m['round']} | {m['client']} | {kind} | {x['max_gap_s'] * 1000:.0f} "
                f"| {x['max_health_s'] * 1000:.0f} | {seconds} |"
            )
    print("\nlongest stream gap, median (min-max) ms:\n")
    print("| client | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 1) + "|")
    for client in sorted({m["client"] for m in rounds}):
        cells = []
        for kind in KINDS:
            gaps = [m[kind]["max_gap_s"] * 1000 for m in rounds if m["client"] == client]
            cells.append(f"{statistics.median(gaps):.0f} ({min(gaps):.0f}-{max(gaps):.0f})")
        print(f"| {client} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": describe(), "first": first, "rounds": rounds, "args": vars(args)}, f, indent=2
            )


if __name__ == "__main__":
    main()
