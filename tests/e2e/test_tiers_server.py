"""KV tiers through real server processes: a warmed text survives a restart (disk), per-tier numbers in
/v1/stats and /metrics, kill -9 while the disk tier writes, and a Redis outage under a live server."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TINY_FLAGS, Server, launch, stop
from tests.redis_server import RedisServer

CHUNK = 128
TEXT_IDS = [(7 * i + 3) % 400 + 10 for i in range(4 * CHUNK)]  # 4 chunks of tiny-random-llama ids


def complete(server: Server, prompt: list[int], max_tokens: int = 6) -> str:
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={
                "model": "tiny-random-llama",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def tiers(server: Server) -> dict:
    return server.stats()["cache"]["tiers"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Answers of a server with no tier (and no reuse) for the prompts below."""
    server = launch(tmp_path_factory.mktemp("ref"), *TINY_FLAGS, "--no-enable-prefix-caching")
    try:
        prompts = {"warmed": TEXT_IDS + [11, 12, 13]}
        prompts.update(
            {f"p{i}": [(i * 31 + 5 * j) % 500 + 7 for j in range(2 * CHUNK + 9)] for i in range(8)}
        )
        return {name: complete(server, p) for name, p in prompts.items()} | {"_prompts": prompts}
    finally:
        stop(server)


def test_warmed_text_survives_a_restart_and_the_tiers_are_reported(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    flags = (*TINY_FLAGS, "--kv-disk-dir", str(disk))
    first = launch(tmp_path, *flags)
    with first.http() as h:
        assert h.post("/v1/warm", json={"prompt_token_ids": TEXT_IDS}).status_code == 200
    stop(first)  # SIGTERM: the queued writes are stored before the process ends
    assert len(list(disk.glob("*.kv"))) == 4

    second = launch(tmp_path, *flags)
    try:
        prompt = reference["_prompts"]["warmed"]
        assert complete(second, prompt) == reference["warmed"]
        t = tiers(second)
        assert set(t) == {"hot", "disk"}
        assert t["disk"]["loads"] == 4 and t["disk"]["hits"] == 4 and t["disk"]["corruptions"] == 0
        assert second.stats()["cache"]["hit_tokens"] == 4 * CHUNK
        with second.http() as h:
            metrics = h.get("/metrics").text
        assert 'kvserve:tier_loads_total{model_name="tiny-random-llama",tier="disk"} 4.0' in metrics
        assert 'kvserve:tier_chunks{model_name="tiny-random-llama",tier="disk"} 4.0' in metrics
    finally:
        stop(second)


def test_kill_9_while_the_disk_tier_writes_never_serves_a_wrong_answer(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    flags = (*TINY_FLAGS, "--kv-disk-dir", str(disk), "--kv-disk-write", "all")
    prompts = reference["_prompts"]
    names = [f"p{i}" for i in range(8)]
    server = launch(tmp_path, *flags)
    done: list[str] = []

    def traffic() -> None:
        for name in names:
            try:
                complete(server, prompts[name])
                done.append(name)
            except Exception:  # the server is killed under it
                return

    thread = threading.Thread(target=traffic)
    thread.start()
    while len(done) < 3 and thread.is_alive():
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    thread.join(30)

    restarted = launch(tmp_path, *flags)
    try:
        for name in names:
            assert complete(restarted, prompts[name]) == reference[name], name
        t = tiers(restarted)
        assert t["disk"]["corruptions"] == 0  # atomic writes: no torn file is ever visible
        assert t["disk"]["loads"] >= 2  # chunks written before the kill are found (at least one prompt's)
        assert not [p for p in disk.iterdir() if p.name.startswith(".tmp-")]  # the dead writer's temp files
    finally:
        stop(restarted)


def test_a_redis_outage_under_a_live_server(tmp_path: Path, reference):
    prompts = reference["_prompts"]
    with RedisServer() as redis:
        server = launch(tmp_path, *TINY_FLAGS, "--kv-redis-url", redis.url)
        try:
            assert complete(server, prompts["p0"]) == reference["p0"]
            redis.kill()
            for name in ("p1", "p2"):  # computed: no error reaches the client
                assert complete(server, prompts[name]) == reference[name]
            assert tiers(server)["redis"]["fallbacks"] + tiers(server)["redis"]["write_errors"] > 0
            assert server.stats()["cache"]["tiers"]["redis"]["tier"] == "redis"
            redis.start()
            time.sleep(1.2)  # the tier retries after 1 s
            assert complete(server, prompts["p3"]) == reference["p3"]
            deadline = time.monotonic() + 10
            while tiers(server)["redis"]["writes"] < 2 + 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tiers(server)["redis"]["writes"] >= 2 + 2  # p0's 2 chunks before, p3's 2 after
        finally:
            stop(server)
        other = launch(tmp_path, *TINY_FLAGS, "--kv-redis-url", redis.url)
        try:
            assert complete(other, prompts["p3"]) == reference["p3"]
            assert tiers(other)["redis"]["loads"] == 2
        finally:
            stop(other)


def test_two_servers_share_one_disk_tier(tmp_path: Path, reference):
    """docs/tiers.md, "Sharing": on one host, processes may share the directory; each serves what
    the other wrote, and answers stay exact."""
    disk = tmp_path / "kv"
    flags = (*TINY_FLAGS, "--kv-disk-dir", str(disk), "--kv-disk-write", "all")
    prompts = reference["_prompts"]
    a, b = launch(tmp_path, *flags), launch(tmp_path, *flags)
    try:
        for i, name in enumerate(f"p{i}" for i in range(6)):
            writer, reader = (a, b) if i % 2 == 0 else (b, a)
            assert complete(writer, prompts[name]) == reference[name]
            deadline = time.monotonic() + 10  # the writer thread stores both chunks
            while tiers(writer)["disk"]["writes"] < 2 * (i // 2 + 1) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert complete(reader, prompts[name]) == reference[name]
        for server in (a, b):
            t = tiers(server)["disk"]
            assert t["loads"] == 2 * 3 and t["corruptions"] == 0  # each read the other's 3 prompts
    finally:
        stop(a)
        stop(b)


# --- the shutdown write: a graceful stop writes the hot chunks the disk lacks (docs/tiers.md) ---------


def complete_cached(server: Server, prompt: list[int]) -> tuple[str, int]:
    """The greedy answer and the prompt's cached tokens."""
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={"model": "tiny-random-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0},
        )
        assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_served_prompt_survives_a_graceful_restart(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    flags = (*TINY_FLAGS, "--kv-disk-dir", str(disk))  # --kv-disk-write evicted: nothing is evicted
    prompt = reference["_prompts"]["p0"]
    first = launch(tmp_path, *flags)
    assert complete_cached(first, prompt) == (reference["p0"], 0)
    stop(first)  # SIGTERM
    assert len(list(disk.glob("*.kv"))) == 2
    assert "shutdown write done" in first.log() and "2 chunks written" in first.log()

    second = launch(tmp_path, *flags)
    try:
        assert complete_cached(second, prompt) == (reference["p0"], 2 * CHUNK)
        assert tiers(second)["disk"]["loads"] == 2 and tiers(second)["disk"]["corruptions"] == 0
    finally:
        stop(second)


def test_the_shutdown_write_keeps_the_most_valuable_chunks_within_kv_disk_bytes(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    cap = 330_000  # two entries of tiny-random-llama (128 KiB of KV a chunk), not three
    flags = (*TINY_FLAGS, "--kv-disk-dir", str(disk), "--kv-disk-bytes", str(cap))
    prompts = reference["_prompts"]
    first = launch(tmp_path, *flags)
    for _ in range(3):
        complete_cached(first, prompts["p1"])  # three uses: worth more than p2's one (lru_freq)
    complete_cached(first, prompts["p2"])
    stop(first)
    sizes = [p.stat().st_size for p in disk.glob("*.kv")]
    assert len(sizes) == 2 and 2 * sizes[0] <= cap < 3 * sizes[0], sizes
    assert "2 over kv_disk_bytes" in first.log()

    second = launch(tmp_path, *flags)
    try:
        assert complete_cached(second, prompts["p2"]) == (reference["p2"], 0)
        assert complete_cached(second, prompts["p1"]) == (reference["p1"], 2 * CHUNK)
    finally:
        stop(second)


def test_the_shutdown_write_stops_at_its_time_cap(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    server = launch(tmp_path, *TINY_FLAGS, "--kv-disk-dir", str(disk), "--kv-disk-shutdown-write-s", "1e-9")
    assert complete_cached(server, reference["_prompts"]["p3"]) == (reference["p3"], 0)
    stop(server)
    assert not list(disk.glob("*.kv"))
    log = server.log()
    assert "shutdown write of up to 2 hot chunks" in log
    assert "2 left at the time cap (kv_disk_shutdown_write_s)" in log, log[-2000:]
