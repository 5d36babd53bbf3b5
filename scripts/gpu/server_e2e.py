"""A short live-server run on a GPU: a real `kvserve` process on CUDA, driven by the OpenAI SDK.

Checks, each a line of the table (PASS / FAIL and a figure):
- the server runs on the device asked for (its start-up line names device and attention backend);
- a chat completion and the same request streamed give the same greedy text (the second is served
  from the prefix cache, which must not change an answer), and its usage counts cached tokens;
- a completion with logprobs; a request sharing a long system prompt reuses its KV (cached_tokens);
- a bad parameter is a 400 in the OpenAI shape, and the server keeps serving;
- TTFT of the streamed requests, p50, as the client sees it.

    python scripts/gpu/server_e2e.py --model .gpu-bundle/models/smollm2-135m [--json server.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = [""]  # the served model's id, read from /v1/models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "--model",
        args.model,
        "--device",
        args.device,
        "--port",
        str(port),
    ]
    cmd += ["--attention-backend", args.attention_backend, "--max-cache-bytes", str(args.max_cache_bytes)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy after {args.start_timeout} s:\n{log.read_text()[-3000:]}")


def streamed(client, messages, max_tokens: int) -> tuple[str, float]:
    """(text, client-side TTFT in seconds) of a streamed greedy chat completion."""
    t0 = time.perf_counter()
    first, parts = None, []
    stream = client.chat.completions.create(
        model=MODEL[0], messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), (first or time.perf_counter()) - t0


def run_checks(client, log: Path, device: str) -> list[tuple[str, bool, str]]:
    import openai

    MODEL[0] = client.models.list().data[0].id
    started = next((line.strip() for line in log.read_text().splitlines() if "attention backend" in line), "")
    checks = [(f"runs on {device}", f"device {device}" in started, started)]  # cli.py's start-up line
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    full = client.chat.completions.create(model=MODEL[0], messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content or ""
    checks.append(("chat completion", bool(text) and full.usage.completion_tokens > 0, repr(text[:60])))
    again, _ = streamed(client, messages, 24)
    cached = client.chat.completions.create(model=MODEL[0], messages=messages, max_tokens=24, temperature=0)
    hits = cached.usage.prompt_tokens_details.cached_tokens if cached.usage.prompt_tokens_details else 0
    checks.append(("stream == non-stream (greedy)", again == text, f"{len(again)} chars"))
    checks.append(
        ("cached answer unchanged", cached.choices[0].message.content == text, f"cached_tokens {hits}")
    )
    comp = client.completions.create(
        model=MODEL[0], prompt="The capital of France is", max_tokens=8, logprobs=2
    )
    lp = comp.choices[0].logprobs
    checks.append(
        ("completion logprobs", bool(lp and lp.top_logprobs), f"{len(lp.tokens) if lp else 0} tokens")
    )
    system = {
        "role": "system",
        "content": " ".join(f"Rule {i}: answer briefly and politely." for i in range(60)),
    }
    ttfts = []
    for question in ("What is two plus two?", "What colour is the sky?", "Who wrote Hamlet?"):
        _, t = streamed(client, [system, {"role": "user", "content": question}], 8)
        ttfts.append(t)
    shared = client.chat.completions.create(
        model=MODEL[0],
        messages=[system, {"role": "user", "content": "And the sea?"}],
        max_tokens=4,
        temperature=0,
    )
    reused = shared.usage.prompt_tokens_details.cached_tokens if shared.usage.prompt_tokens_details else 0
    checks.append(
        ("shared system prompt reused", reused > 0, f"cached_tokens {reused} of {shared.usage.prompt_tokens}")
    )
    try:
        client.chat.completions.create(model=MODEL[0], messages=messages, max_tokens=4, temperature=-1)
        checks.append(("bad parameter is a 400", False, "accepted"))
    except openai.BadRequestError as exc:
        checks.append(("bad parameter is a 400", exc.status_code == 400, str(exc)[:80]))
    after = client.chat.completions.create(model=MODEL[0], messages=messages, max_tokens=4, temperature=0)
    checks.append(("serves after the error", bool(after.choices[0].message.content), ""))
    checks.append(("TTFT p50 (streamed)", True, f"{statistics.median(ttfts) * 1e3:.1f} ms"))
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-cache-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--log", default=os.environ.get("RESULTS", "/tmp") + "/server_process.log")
    ap.add_argument(
        "--check-args",
        action="store_true",
        help="parse the arguments and import the GPU path, then stop (scripts/gpu/run.sh's CPU dry run)",
    )
    ap.add_argument("--json", help="also write the checks here")
    args = ap.parse_args()
    if args.check_args:
        import openai  # noqa: F401

        import kvserve.api.server  # noqa: F401

        return print("arguments ok")
    from openai import OpenAI

    port = free_port()
    started = time.perf_counter()
    proc = start(args, port, Path(args.log))
    print(f"# server healthy in {time.perf_counter() - started:.1f} s (log {args.log})")
    base_url = f"http://127.0.0.1:{port}"
    try:
        client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        checks = run_checks(client, Path(args.log), args.device)
    finally:
        proc.terminate()
        proc.wait(30)
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<32} {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"check": n, "ok": ok, "detail": d} for n, ok, d in checks], f, indent=1)
    sys.exit(0 if all(ok for _, ok, _ in checks) else 1)


if __name__ == "__main__":
    main()
