"""This tree against another git revision, interleaved in one run: cold TTFT and decode throughput.

Each tree runs in its own worker process (its own kvserve, its own CPU-extension build directory) with
the model loaded once; the parent alternates the same measurements between the workers, trial by
trial, so that load from other processes hits both alike. Prints one table of medians and ratios.

  cold TTFT     a never-seen prompt of --prompt-tokens tokens, max_tokens=1 (prefill dominates)
  warm TTFT     a prefix of --prompt-tokens tokens cached by the request before, then a new 64-token
                suffix after it (the prefix-reuse benchmark's warm case)
  decode x1     generated tokens/s of one request (short prompt), decode phase only
  decode x8     the same with 8 concurrent requests
  decode x32    the same with 32 (issue 63's "32 concurrent chats": the engine's own step cost shows)
  attention     cpu_paged alone, SmolLM2's shape (9 / 3 heads, head_dim 64), fp32 KV, mixed block layout:
                decode of 1 and 8 sequences at 2k and 8k, 256 new tokens over 2k, a whole 2k prompt (ms)

    python scripts/bench_ab.py --base HEAD~3 [--trials 5] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.machine import describe

ROOT = Path(__file__).resolve().parents[1]

# Runs in the other revision's tree (its cwd and PYTHONPATH), which may have no scripts/harness: so it
# carries its own copy of harness.texts.corpus_tokens, as `corpus`.
WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from kvserve import LLM, SamplingParams
from kvserve.request import Request

def corpus(llm, n, seed):
    from pydoc_data.topics import topics
    keys = sorted(topics)
    ids, i = [], seed
    while len(ids) < n:
        ids += llm.tokenizer.encode(topics[keys[(i * 7919) % len(keys)]])
        i += 1
    return ids[:n]

def decode_tok_s(llm, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"dec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.engine.add_request(Request(rid, p, params))
    remaining, started, t0, tokens = set(ids), False, 0.0, 0
    while remaining:
        for out in llm.engine.step():
            tokens += len(out.new_token_ids) if started else 0
            if out.finished:
                remaining.discard(out.request_id)
        if not started and all(
            llm.engine.scheduler.find(r) is None or llm.engine.scheduler.find(r).output_token_ids for r in ids
        ):
            started, t0 = True, time.perf_counter()
    return tokens / (time.perf_counter() - t0)

def attention_ms(case):
    try:
        from kvserve.attention.testing import make_batch
    except ImportError:  # before it moved
        from kvserve.kernels.paged_batch import make_batch
    from kvserve.attention.registry import create_backend
    batch, q_len, ctx = (int(x) for x in case.split("x"))
    query, kv, meta = make_batch([(q_len, ctx)] * batch, 9, 3, 64, 16, torch.float32, "mixed")
    backend = create_backend("cpu_paged", torch.device("cpu"))
    backend.forward(query, kv, meta, 0.125)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        backend.forward(query, kv, meta, 0.125)
        times.append(time.perf_counter() - t0)
    return sorted(times)[3]

llm = LLM(model=sys.argv[2], max_cache_bytes=2_000_000_000)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd, n, seed = line.split()
    if cmd == "attn":
        result = attention_ms(n)
    elif cmd == "cold":
        (out,) = llm.generate([corpus(llm, int(n), seed=int(seed))], SamplingParams(max_tokens=1, temperature=0))
        result = out.metrics.ttft_s
    elif cmd == "warm":  # a cached prefix of n tokens and a new 64-token suffix (bench_prefix_reuse's warm)
        prefix, one = corpus(llm, int(n), seed=100 + int(seed)), SamplingParams(max_tokens=1, temperature=0)
        llm.generate([prefix + corpus(llm, 64, seed=200 + int(seed))], one)
        (out,) = llm.generate([prefix + corpus(llm, 64, seed=300 + int(seed))], one)
        result = out.metrics.ttft_s
    else:
        result = decode_tok_s(llm, [corpus(llm, 32, seed=5000 + i) for i in range(int(n))], 64)
    print(json.dumps({"result": result}), flush=True)
"""


class Worker:
    def __init__(self, name: str, tree: Path, ext_dir: Path, threads: int, model: str):
        env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir))
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(threads), model],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died")
        return json.loads(line)

    def ask(self, cmd: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return float(self._read()["result"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def checkout(rev: str, into: Path) -> None:
    """`rev`'s files (no .git) under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare this working tree against")
    ap.add_argument("--base-tree", default="", help="an existing checkout of --base to use instead (kept)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["cold", "warm", "decode1", "decode8"],
        choices=["cold", "warm", "decode1", "decode8", "decode32", "attention"],
    )
    ap.add_argument(
        "--base-ext-dir", default="", help="build directory of the base tree's CPU extension (kept)"
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvserve-ab-") as tmp:
        base_tree = Path(args.base_tree or Path(tmp) / "base")
        if not args.base_tree:
            base_tree.mkdir()
            checkout(args.base, base_tree)
        ext_root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path(tmp) / "ext"))
        base_ext = Path(args.base_ext_dir or Path(tmp) / "ext-base")
        workers = [
            Worker("base", base_tree, base_ext, args.threads, args.model),
            Worker("this", ROOT, ext_root, args.threads, args.model),
        ]
        all_cases = {"cold": ("cold TTFT (ms)", f"cold {args.prompt_tokens}", 1e3),
                     "warm": ("warm TTFT (ms)", f"warm {args.prompt_tokens}", 1e3),
                     "decode1": ("decode x1 (tok/s)", "decode 1", 1.0),
                     "decode8": ("decode x8 (tok/s)", "decode 8", 1.0),
                     "decode32": ("decode x32 (tok/s)", "decode 32", 1.0)}  # fmt: skip
        attention = [  # batch x q_len x context
            (f"attention {b} x {q} x {c} (ms)", f"attn {b}x{q}x{c}", 1e3)
            for b, q, c in [
                (1, 1, 2048),
                (1, 1, 8192),
                (8, 1, 2048),
                (8, 1, 8192),
                (1, 256, 2048),
                (1, 2048, 2048),
            ]
        ]
        cases = [case for c in args.cases for case in (attention if c == "attention" else [all_cases[c]])]
        # the same never-seen prompt for both trees in a trial: seeds 1.. per trial, 0 for the warm-up
        results: dict[str, dict[str, list[float]]] = {c: {w.name: [] for w in workers} for c, _, _ in cases}
        for w in workers:  # warm-up: first calls pay one-off costs
            w.ask(f"cold {args.prompt_tokens} 0")
            w.ask("decode 8 0")
        for trial in range(args.trials):
            for case, cmd, unit in cases:
                for w in workers if trial % 2 == 0 else workers[::-1]:
                    results[case][w.name].append(w.ask(f"{cmd} {trial + 1}") * unit)
        for w in workers:
            w.close()
    machine = describe(args.threads)
    print(f"# bench_ab: {args.model}, this tree vs {args.base}, {args.trials} trials (median); {machine}")
    print("| measurement | base | this | this / base |")
    print("|---|---|---|---|")
    for case, _, _ in cases:
        base, this = (statistics.median(results[case][n]) for n in ("base", "this"))
        print(f"| {case} | {base:.1f} | {this:.1f} | {this / base:.2f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine, "base": args.base, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
