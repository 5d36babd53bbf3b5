"""Fair admission at saturation (issue 62): TTFT of a minority prefix beside a hot one.

`--hot-clients` clients loop requests that share a ~400-token system prompt (each a new question,
`--hot-tokens` output tokens), so that prompt's group in the admission queue never empties; one
minority client sends a prompt with a prefix of its own (a new one each time: it never hits the
cache), waits for the answer, pauses `--minority-pause-s`, and sends the next. Every request streams,
so TTFT is measured as a client sees it. Each system gets a fresh server (`--max-num-seqs 2`, as the
reproduction) and `--seconds` of load after a warm-up; systems run in turn, `--rounds` times, rotated.

Systems:
  fifo      --prefix-group-window-ms 0: first come, first served (the reference)
  grouped   the default window (kvserve.config.ServeConfig.prefix_group_window_ms)
  main      a server started from another checkout (`--main-root DIR`, e.g. a git worktree of the
            commit before the fix), to compare the prefix hit rate with it

    .venv/bin/python scripts/bench_fairness.py --seconds 60 --rounds 2 --out out/bench/fairness.json
    .venv/bin/python scripts/bench_fairness.py --report out/bench/fairness.json

Prints one table (the machine named first); `--out` keeps every request.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.machine import describe, machine  # noqa: E402
from harness.report import percentile  # noqa: E402
from peers.launch import ROOT, System, exit_on_sigterm, running  # noqa: E402

MODEL = "smollm2-135m"
SYSTEM_PROMPT = " ".join(f"Rule {i}: answer in one short sentence and cite rule {i}." for i in range(36))
WORDS = "river stone cloud maple copper violet harbor lantern meadow saddle tundra quartz".split()


def systems(main_root: str | None) -> dict[str, System]:
    flags = ("--max-num-seqs", "2")
    exe = str(ROOT / ".venv/bin/python")
    out = {
        "fifo": System(
            "fifo",
            (
                exe,
                "-m",
                "kvserve.cli",
                "--model",
                MODEL,
                "--port",
                "{port}",
                *flags,
                "--prefix-group-window-ms",
                "0",
            ),
        ),
        "grouped": System(
            "grouped", (exe, "-m", "kvserve.cli", "--model", MODEL, "--port", "{port}", *flags)
        ),
    }
    if main_root:  # the other checkout's package first on the path; same venv, same flags
        env = (("PYTHONPATH", str(Path(main_root).resolve())),)
        argv = (
            "/bin/sh",
            "-c",
            f"cd {main_root} && exec {exe} -m kvserve.cli --model {MODEL} --port {{port}} " + " ".join(flags),
        )
        out["main"] = System("main", argv, env=env)
    return out


def stream_ttft(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total latency) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    ttft = None
    with client.stream("POST", "/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - t0
    end = time.monotonic() - t0
    return (ttft if ttft is not None else end), end


def load(base_url: str, args: argparse.Namespace, seed: int) -> dict:
    """Warm-up, then `args.seconds` of hot clients beside the minority client."""
    stop = threading.Event()
    records: list[dict] = []
    lock = threading.Lock()

    def hot(worker: int) -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            k = 0
            while not stop.is_set():
                k += 1
                prompt = f"{SYSTEM_PROMPT}\nQuestion {worker}.{k}: which rule covers {WORDS[k % len(WORDS)]}?"
                ttft, total = stream_ttft(client, prompt, args.hot_tokens)
                with lock:
                    records.append(
                        {"kind": "hot", "ttft_s": ttft, "latency_s": total, "end": time.monotonic()}
                    )

    def minority() -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base_url, timeout=600) as client:
            while not stop.is_set():
                words = " ".join(rng.choice(WORDS) for _ in range(60))
                ttft, total = stream_ttft(client, f"Note {rng.random():.9f}: {words}\nSummarize:", 8)
                with lock:
                    records.append(
                        {"kind": "minority", "ttft_s": ttft, "latency_s": total, "end": time.monotonic()}
                    )
                stop.wait(args.minority_pause_s)

    with httpx.Client(base_url=base_url, timeout=600) as client:  # first-use costs out of the measurement
        stream_ttft(client, f"{SYSTEM_PROMPT}\nQuestion: warm-up?", 4)
        stream_ttft(client, "warm-up", 4)
        before = client.get("/stats").json()
    threads = [threading.Thread(target=hot, args=(w,), daemon=True) for w in range(args.hot_clients)]
    for t in threads:
        t.start()
    time.sleep(args.ramp_s)  # the hot group fills first
    t_start = time.monotonic()
    mt = threading.Thread(target=minority, daemon=True)
    mt.start()
    stop.wait(args.seconds)
    stop.set()
    for t in [*threads, mt]:
        t.join(600)
    with httpx.Client(base_url=base_url, timeout=60) as client:
        after = client.get("/stats").json()
    hits = after["cache"]["hit_tokens"] - before["cache"]["hit_tokens"]
    queries = after["cache"]["query_tokens"] - before["cache"]["query_tokens"]
    measured = [r for r in records if r["end"] >= t_start]
    return {"records": measured, "hit_tokens": hits, "query_tokens": queries}


def summarize(name: str, runs: list[dict]) -> dict:
    recs = [r for run in runs for r in run["records"]]
    minority = [r["ttft_s"] for r in recs if r["kind"] == "minority"]
    hot = [r["ttft_s"] for r in recs if r["kind"] == "hot"]
    hits = sum(r["hit_tokens"] for r in runs)
    queries = sum(r["query_tokens"] for r in runs)
    return {
        "system": name,
        "minority_n": len(minority),
        "minority_ttft_p50_s": percentile(minority, 50),
        "minority_ttft_p99_s": percentile(minority, 99),
        "hot_n": len(hot),
        "hot_ttft_p50_s": percentile(hot, 50),
        "hot_ttft_p99_s": percentile(hot, 99),
        "prefix_hit_rate": hits / queries if queries else None,
    }


def table(data: dict) -> str:
    rows = [summarize(name, runs) for name, runs in data["runs"].items()]
    fifo = next((r for r in rows if r["system"] == "fifo"), None)

    def ratio(r: dict, key: str) -> str:
        if fifo is None or not fifo[key] or r[key] is None:
            return "-"
        return f"{r[key] / fifo[key]:.2f}x"

    def num(v: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = [
        f"Machine: {data['meta']['describe']}. Command: `{data['meta']['command']}`.",
        "",
        "| system | minority requests | minority TTFT p50 (s) | minority TTFT p99 (s) | p99 / FIFO's | hot requests "
        "| hot TTFT p50 (s) | hot TTFT p99 (s) | prefix hit rate | hit rate / FIFO's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['minority_n']} | {num(r['minority_ttft_p50_s'])} | {num(r['minority_ttft_p99_s'])} "
            f"| {ratio(r, 'minority_ttft_p99_s')} | {r['hot_n']} | {num(r['hot_ttft_p50_s'])} "
            f"| {num(r['hot_ttft_p99_s'])} | {num(r['prefix_hit_rate'])} | {ratio(r, 'prefix_hit_rate')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="fifo,grouped", help="comma-separated: fifo, grouped, main")
    p.add_argument("--main-root", help="checkout the `main` system runs from (a worktree of the old commit)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured load per system and round")
    p.add_argument("--ramp-s", type=float, default=3.0, help="hot clients alone before the minority starts")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--hot-clients", type=int, default=6)
    p.add_argument("--hot-tokens", type=int, default=24)
    p.add_argument("--minority-pause-s", type=float, default=1.0)
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--out", type=Path)
    p.add_argument("--report", type=Path, help="print the table of a saved run")
    args = p.parse_args()
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return
    exit_on_sigterm()
    specs = systems(args.main_root)
    names = args.systems.split(",")
    unknown = [n for n in names if n not in specs]
    if unknown:
        p.error(f"unknown systems {unknown} (main needs --main-root)")
    data = {
        "meta": {
            "machine": machine(),
            "describe": describe(),
            "command": " ".join(sys.argv),
            "args": {k: str(v) for k, v in vars(args).items()},
        },
        "runs": {n: [] for n in names},
    }
    log_dir = Path(args.out or "out/bench/fairness.json").parent / "logs"
    for k in range(args.rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            with running(specs[name], args.port, log_dir / f"fairness-{name}.log") as (_pid, base_url):
                run = load(base_url, args, seed=k)
            data["runs"][name].append(run)
            print(f"round {k + 1} {name}: {summarize(name, [run])}", flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(data, indent=1))
    print(table(data))


if __name__ == "__main__":
    main()
