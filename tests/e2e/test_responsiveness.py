"""The event loop never waits for the engine or the tokenizer: /health and /v1/stats answer quickly
while a long prefill step runs or a huge prompt is tokenized; SIGTERM during generation shuts down
cleanly. The server runs the reference attention backend, whose long prefill steps (seconds for
2,000 tokens of tiny-random-llama) make a waiting reader visible."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop, wait_until

FLAGS = (*TINY_FLAGS, "--attention-backend", "reference", "--max-num-batched-tokens", "2048")
QUICK_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = launch(tmp_path_factory.mktemp("kvserve"), *FLAGS)
    yield s
    stop(s)


def _timed_get(h: httpx.Client, path: str) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    r = h.get(path)
    return time.monotonic() - t0, r


def _poll_while(server: Server, busy: threading.Thread, paths: tuple[str, ...]) -> list[tuple[str, float]]:
    """GET each path every 0.1 s while `busy` runs; (path, seconds) per answer."""
    times: list[tuple[str, float]] = []
    with server.http() as h:
        while busy.is_alive():
            for path in paths:
                elapsed, r = _timed_get(h, path)
                assert r.status_code == 200, r.text
                times.append((path, elapsed))
            time.sleep(0.1)
    return times


def _check_quick(what: str, seconds: float, times: list[tuple[str, float]]) -> None:
    """Every answer under QUICK_S and far shorter than the work it overlapped (a reader that waits
    for the work takes about as long as it)."""
    worst = {p: round(max(t for q, t in times if q == p), 3) for p, _ in times}
    print(f"\nduring a {seconds:.1f} s {what}: {len(times)} answers, slowest {worst}")
    assert times, f"no answer at all during a {seconds:.1f} s {what}"
    slowest = max(worst.values())
    assert slowest < QUICK_S and 4 * slowest < seconds, (
        f"slow answers during a {seconds:.1f} s {what}: {worst}"
    )


def _poll_during_post(
    server: Server, prompt: object, settle_s: float, paths: tuple[str, ...]
) -> tuple[int, float, list[tuple[str, float]]]:
    """POSTs a 1-token completion of `prompt` on a thread and polls `paths` until it answers:
    (its status, its seconds, the poll times)."""
    result: dict[str, float] = {}

    def post() -> None:
        with server.http() as h:
            t0 = time.monotonic()
            r = h.post("/v1/completions", json={"model": TINY, "prompt": prompt, "max_tokens": 1})
            result["status"], result["seconds"] = r.status_code, time.monotonic() - t0

    busy = threading.Thread(target=post)
    busy.start()
    time.sleep(settle_s)
    times = _poll_while(server, busy, paths)
    busy.join()
    return int(result["status"]), result["seconds"], times


def test_stats_and_health_answer_during_a_long_prefill(server: Server) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(2000)]
    status, seconds, times = _poll_during_post(server, prompt, 0.3, ("/health", "/v1/stats", "/metrics"))
    assert status == 200
    _check_quick("prefill", seconds, times)


def test_health_answers_while_a_huge_prompt_is_tokenized(server: Server) -> None:
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "cache", "serve", "token", "xyzzy"]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(390_000))[:3_900_000]
    status, seconds, times = _poll_during_post(server, text, 0.2, ("/health", "/v1/stats"))
    assert status == 400  # far longer than the context: rejected after tokenizing
    _check_quick("tokenization", seconds, times)


def test_sigterm_during_generation_shuts_down_cleanly(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = launch(tmp_path_factory.mktemp("kvserve"), *TINY_FLAGS)
    results: dict[str, object] = {}
    body = {"model": TINY, "prompt": "go", "max_tokens": 3000, "ignore_eos": True}

    def whole() -> None:
        try:
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            results["whole"] = (r.status_code, r.json())
        except Exception as e:
            results["whole"] = e

    def streamed() -> None:
        events: list[str] = []
        try:
            with httpx.stream(
                "POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                events += [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            results["stream"] = events
        except Exception as e:
            results["stream"] = e

    try:
        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert wait_until(lambda: server.stats()["queue"]["running"] == 2, 30)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        if server.proc.poll() is None:
            stop(server)
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log[-4000:]
    # each in-flight request finished or got a clean error: a 503 envelope, or an error event then [DONE]
    status, whole_body = results["whole"]  # type: ignore[misc]
    assert status in (200, 503), whole_body
    if status == 503:
        assert "shutting down" in whole_body["error"]["message"]
    events = results["stream"]
    assert isinstance(events, list) and events[-1] == "[DONE]", events
    last = json.loads(events[-2])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
