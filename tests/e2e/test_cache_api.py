"""Prefix reuse over HTTP: cached_tokens, /v1/warm, /v1/stats, /metrics, and disconnect aborts."""

from __future__ import annotations

import itertools
import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop, wait_until

CHUNK = 128


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _cached(server: Server, prompt: list[int]) -> int:
    r = server.client().completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_cached_tokens_grow_on_a_repeated_prefix(tiny_server: Server) -> None:
    prefix = _ids(1, 300)
    assert _cached(tiny_server, prefix) == 0
    # 2 chunks, and the 2 whole blocks (16 tokens each) the first request computed past them (a block tail)
    assert _cached(tiny_server, prefix + _ids(2, 20)) == 2 * CHUNK + 32
    longer = prefix + _ids(2, 20) + _ids(3, 200)
    assert _cached(tiny_server, longer) == 2 * CHUNK + 64  # the second request's 4 whole blocks past them
    assert _cached(tiny_server, longer + [5]) == 4 * CHUNK  # the previous request's chunks were registered
    # another cache_salt never sees them
    r = tiny_server.client().completions.create(
        model=TINY, prompt=prefix, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_warm_then_hit_stats_metrics_and_unpin(tiny_server: Server) -> None:
    doc = _ids(10, 300)
    before = tiny_server.stats()
    with tiny_server.http() as h:
        warm = h.post("/v1/warm", json={"prompt_token_ids": doc}).json()
        assert warm == {
            "num_tokens": 300,
            "num_cacheable_tokens": 256,
            "num_cached_tokens": 0,
            "num_cached_chunks": 0,
            "num_new_chunks": 2,
            "pinned": True,
        }
        again = h.post("/v1/warm", json={"prompt_token_ids": doc}).json()
        assert again["num_new_chunks"] == 0 and again["num_cached_chunks"] == 2
        assert _cached(tiny_server, doc + _ids(11, 5)) == 256
        stats = tiny_server.stats()
        # 2 whole chunks plus the 44-token tail (kept for position-independent matches)
        assert stats["cache"]["pinned_chunks"] == before["cache"]["pinned_chunks"] + 3
        assert stats["cache"]["hit_tokens"] >= before["cache"]["hit_tokens"] + 256
        assert stats["cache"]["chunks"] >= 2 and stats["cache"]["bytes_per_token"] == 1024
        metrics = h.get("/metrics").text
        assert _metric(metrics, "kvserve:prefix_cache_hits_total") == stats["cache"]["hit_tokens"]
        assert _metric(metrics, "kvserve:prefix_cache_queries_total") == stats["cache"]["query_tokens"]
        assert _metric(metrics, "kvserve:pinned_chunks") == stats["cache"]["pinned_chunks"]
        assert _metric(metrics, "kvserve:cached_bytes") == stats["cache"]["cached_bytes"] > 0
        unpin = h.request("DELETE", "/v1/warm", json={"prompt_token_ids": doc}).json()
        assert unpin["num_unpinned_chunks"] == 3
        assert tiny_server.stats()["cache"]["pinned_chunks"] == before["cache"]["pinned_chunks"]


def test_warm_chat_prefix_is_shared_by_later_chats(tiny_server: Server) -> None:
    system = {"role": "system", "content": " ".join(f"rule {i}: be precise." for i in range(60))}
    with tiny_server.http() as h:
        warm = h.post("/v1/warm", json={"messages": [system], "pin": False}).json()
        assert warm["num_cacheable_tokens"] >= CHUNK and warm["pinned"] is False
    r = tiny_server.client().chat.completions.create(
        model=TINY,
        messages=[system, {"role": "user", "content": "hi"}],
        max_tokens=2,  # type: ignore[list-item]
    )
    assert r.usage.prompt_tokens_details.cached_tokens == warm["num_cacheable_tokens"]


def test_stats_and_metrics_shapes(tiny_server: Server) -> None:
    stats = tiny_server.stats()
    assert set(stats) >= {"queue", "cache", "throughput", "latency", "model", "config"}
    assert set(stats["queue"]) >= {"waiting", "running", "rejected", "completed"}
    assert set(stats["cache"]) >= {
        "chunks",
        "blocks_used",
        "blocks_total",
        "bytes_used",
        "bytes_budget",
        "bytes_per_token",
        "codec",
        "pinned_chunks",
        "hit_tokens",
        "query_tokens",
        "hit_rate",
        "evictions",
    }
    assert stats["throughput"]["generation_tokens_per_s"] > 0
    assert stats["latency"]["ttft_s"]["count"] > 0 and stats["latency"]["ttft_s"]["p99"] > 0
    assert stats["config"]["model"] == TINY and stats["model"]["id"] == TINY
    with tiny_server.http() as h:
        text = h.get("/metrics").text
    for name in (
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:generation_tokens_total",
        "kvserve:prompt_tokens_total",
        "kvserve:time_to_first_token_seconds_bucket",
        "kvserve:inter_token_latency_seconds_bucket",
        "kvserve:cache_evictions_total",
    ):
        assert name in text, name


def test_client_disconnect_aborts_the_work(tiny_server: Server) -> None:
    before = tiny_server.stats()
    body = {"model": TINY, "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            got = [line for line in itertools.islice(r.iter_lines(), 6) if line.startswith("data:")]
            assert got
    after = wait_until(
        lambda: (s := tiny_server.stats())["queue"]["aborted"] > before["queue"]["aborted"] and s
    )
    assert after, "the disconnected request was not aborted"
    assert after["queue"]["running"] == 0 and after["queue"]["in_system"] == 0
    generated = after["tokens"]["generated_tokens"] - before["tokens"]["generated_tokens"]
    assert generated < 3000
    assert after["cache"]["blocks_used"] == after["cache"]["cached_blocks"]  # its own blocks were freed


def test_warm_shorter_than_a_chunk_caches_nothing(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        r = h.post("/v1/warm", json={"text": "too short to cache"}).json()
    assert r["num_cacheable_tokens"] == 0 and r["num_new_chunks"] == 0 and r["num_tokens"] > 0


@pytest.fixture(scope="module")
def taking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny server taking every content match (--reuse-min-saving -10). A fresh clone's full run
    (2026-12-07) got no reuse for this test's small plan on the module's shared server, where it passes
    alone; the likely cause is the default 0.1, whose choice follows a cost model fitted to the
    machine's own step times. The test is about opt-in and reporting, not that choice, and now asserts
    the plan first, so a miss says why."""
    server = launch(tmp_path_factory.mktemp("kvserve"), *TINY_FLAGS, "--reuse-min-saving", "-10")
    yield server
    stop(server)


def test_approximate_reuse_is_opt_in_per_request_and_reported(taking_server: Server) -> None:
    doc = _ids(20, 2 * CHUNK)
    prompt = _ids(21, CHUNK) + doc + _ids(22, 9)  # the document one chunk later than it was warmed
    client = taking_server.client()
    with taking_server.http() as h:
        h.post("/v1/warm", json={"prompt_token_ids": doc, "pin": False})
        other = _ids(23, CHUNK) + doc + _ids(22, 9)
        plain = client.completions.create(model=TINY, prompt=other, max_tokens=2, temperature=0)
        assert plain.usage.prompt_tokens_details.cached_tokens == 0  # the server default is exact only
        r = h.post(
            "/v1/completions",
            json={
                "model": TINY,
                "prompt": prompt,
                "max_tokens": 2,
                "temperature": 0,
                "reuse": "any",
                "recompute_strategy": "selective",
                "recompute_tokens": 8,
                "audit": True,
            },
        ).json()
        # content-defined pieces (the default): all but the pieces straddling the document's edges,
        # in one run, so the first 8 tokens of that run are recomputed
        split = r["usage"]["kvserve"]
        assert split["reuse_plans"] == {"taken": 1}, split
        assert split["reuse_presets"] == {"named by the request": 1}
        assert split["exact_cached_tokens"] == 0 and split["recomputed_tokens"] == 8
        assert CHUNK <= split["approx_cached_tokens"] <= 2 * CHUNK - 8
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == split["approx_cached_tokens"]
        # the audit recomputes the prompt in full once the server is idle (it is, after this request)
        stats = taking_server.stats()["cache"]["reuse"]
        for _ in range(100):
            if stats["audit"]:
                break
            time.sleep(0.05)
            stats = taking_server.stats()["cache"]["reuse"]
        assert stats["audit"]["selective"]["num_audited"] == 1 and stats["audit"]["selective"]["kl_max"] >= 0
        assert stats["plans"] == {"taken": 1} and stats["num_audits_pending"] == 0
        assert stats["available"] and stats["num_approx_hit_tokens"] >= CHUNK
        assert stats["auto"]["preset"] is None and stats["auto"]["fell_back"] is None  # none verified
        metrics = h.get("/metrics").text
        assert _metric(metrics, "kvserve:reuse_auto_fell_back") == 0
        assert _metric(metrics, "kvserve:repair_recomputed_tokens_total") >= 8
        assert 'kvserve:audits_total{model_name="' in metrics and "kvserve:audit_first_token_kl{" in metrics
        assert "kvserve:audit_mean_kl{" in metrics and "kvserve:audit_greedy_agreement{" in metrics
        bad = h.post("/v1/completions", json={"model": TINY, "prompt": prompt, "reuse": "sometimes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reuse"
