"""`kvserve cluster` end to end: a real `kvserve cluster` process (Ray Serve, 2 engine replicas of
the tiny model with small pools and 1 CPU each) over a real redis-server, driven over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import TINY, Server, launch, wait_until
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

REPLICA = "x-kvserve-replica"
SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly and cite the handbook. " * 6 for i in range(4)]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Server]:
    flags = ("cluster", "--replicas", "2", "--replica-cpus", "1", "--model", TINY)
    flags += ("--max-cache-bytes", "32000000", "--chunk-size", "16", "--kv-redis-url", redis.url)
    server = launch(tmp_path_factory.mktemp("kvserve-cluster"), *flags, timeout_s=240)
    yield server
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(90)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


def chat(h: httpx.Client, system: str, user: str, **headers: str) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    r = h.post("/v1/chat/completions", json={**body, "max_tokens": 3, "temperature": 0}, headers=headers)
    assert r.status_code == 200, r.text
    return r


def test_a_system_prompt_stays_on_one_replica(cluster: Server) -> None:
    with cluster.http() as h:
        for system in SYSTEMS:
            served = {chat(h, system, f"question {i}").headers[REPLICA] for i in range(4)}
            assert len(served) == 1, (system[:30], served)
        routing = h.get("/v1/stats").json()["cluster"]["routing"]
    assert routing["decisions"].get("affinity", 0) >= 16, routing


def test_stats_and_metrics_cover_every_replica(cluster: Server) -> None:
    with cluster.http() as h:
        chat(h, SYSTEMS[0], "hello")
        stats = h.get("/v1/stats").json()
        metrics = h.get("/metrics").text
    replicas = stats["replicas"]
    assert stats["cluster"]["replicas"] == len(replicas) == 2
    assert all(r["threads"] == 1 for r in replicas.values())  # --replica-cpus 1
    for key in ("completed", "rejected", "in_system"):
        assert stats["queue"][key] == sum(r["queue"][key] for r in replicas.values())
    for key in ("hit_tokens", "query_tokens", "blocks_total", "chunks"):
        assert stats["cache"][key] == sum(r["cache"][key] for r in replicas.values())
    assert stats["cache"]["hit_rate"] == pytest.approx(
        stats["cache"]["hit_tokens"] / max(1, stats["cache"]["query_tokens"])
    )
    assert stats["latency"]["ttft_s"]["count"] >= 1  # measured at the ingress
    for replica in replicas:
        assert f'replica="{replica}"' in metrics
    assert "# TYPE kvserve:request_success_total counter" in metrics


def test_errors_are_the_single_servers(cluster: Server) -> None:
    with cluster.http() as h:
        bad = h.post("/v1/chat/completions", json={"messages": [], "max_tokens": -1})
        missing = h.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_prefix_warmed_on_one_replica_is_a_redis_hit_on_the_other(cluster: Server) -> None:
    document = "The shared handbook, section 7: " + "every replica reads the same pages. " * 12
    with cluster.http() as h:
        warm = h.post("/v1/warm", json={"text": document})
        assert warm.status_code == 200 and warm.json()["num_new_chunks"] >= 4, warm.text
        a = warm.headers[REPLICA]
        before = h.get("/v1/stats").json()["replicas"]
        b = next(r for r in before if r != a)
        r = h.post(
            "/v1/completions",
            json={"prompt": document + " Question: what do replicas read?", "max_tokens": 2},
            headers={REPLICA: b},
        )
        assert r.status_code == 200 and r.headers[REPLICA] == b
        after = h.get("/v1/stats").json()["replicas"]
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= warm.json()["num_cacheable_tokens"], (cached, warm.json())
    redis_loads = after[b]["cache"]["tiers"]["redis"]["loads"] - before[b]["cache"]["tiers"]["redis"]["loads"]
    assert redis_loads >= warm.json()["num_new_chunks"]


def test_the_ingress_under_a_burst_answers_every_request_cleanly(cluster: Server) -> None:
    """40 requests at once (more than the replicas' slots): each a 200 or a 503 in the OpenAI error shape;
    the cluster serves normally afterwards."""
    import concurrent.futures

    def one(i: int) -> httpx.Response:
        with cluster.http() as h:
            body = {"messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 4}
            return h.post("/v1/chat/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    assert {r.status_code for r in answers} <= {200, 503}, [
        r.text for r in answers if r.status_code not in (200, 503)
    ]
    assert any(r.status_code == 200 for r in answers)
    for r in answers:
        if r.status_code == 503:
            assert r.json()["error"]["message"]
    with cluster.http() as h:
        assert chat(h, SYSTEMS[0], "after the burst").status_code == 200


def test_a_redis_restart_under_the_cluster_costs_no_request(cluster: Server, redis: RedisServer) -> None:
    """Redis killed (its data gone) and started again on the same port: requests are answered throughout,
    and warms are shared through Redis again once it is back."""
    with cluster.http() as h:
        redis.kill()
        for i in range(4):
            assert chat(h, SYSTEMS[i], f"while Redis is down {i}").status_code == 200
        redis.start()
        document = "After the restart: " + "the replicas share the handbook again. " * 12

        def shared() -> bool:
            warm = h.post("/v1/warm", json={"text": document})
            assert warm.status_code == 200, warm.text
            other = next(r for r in h.get("/v1/stats").json()["replicas"] if r != warm.headers[REPLICA])
            r = h.post(
                "/v1/completions",
                json={"prompt": document + " Question: shared?", "max_tokens": 2},
                headers={REPLICA: other},
            )
            assert r.status_code == 200, r.text
            return (
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                >= warm.json()["num_cacheable_tokens"]
            )

        assert wait_until(shared, timeout_s=60, interval_s=2)


def test_requests_survive_a_replica_being_killed(cluster: Server) -> None:
    with cluster.http() as h:
        victim = chat(h, SYSTEMS[1], "before").headers[REPLICA]
        pid = h.get("/v1/stats").json()["replicas"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        served = [chat(h, SYSTEMS[1], f"after {i}").headers[REPLICA] for i in range(6)]
        assert victim not in served
        # Serve replaces the dead replica; the cluster is back to two
        back = wait_until(
            lambda: len(h.get("/v1/stats").json()["replicas"]) == 2, timeout_s=120, interval_s=1
        )
        assert back
        assert chat(h, SYSTEMS[2], "later").status_code == 200


def test_the_openai_client_streams_and_a_client_that_leaves_aborts_on_the_replica(cluster: Server) -> None:
    client = cluster.client()
    messages = [{"role": "system", "content": SYSTEMS[3]}, {"role": "user", "content": "stream"}]
    whole = client.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model=TINY, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer streamed or not
    with cluster.http() as h:
        body = {"messages": messages, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            replica = r.headers[REPLICA]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # it runs; now the client leaves

        def aborted() -> bool:
            queue = h.get("/v1/stats").json()["replicas"][replica]["queue"]
            return queue["in_system"] == 0 and queue["aborted"] >= 1

        assert wait_until(aborted, timeout_s=30, interval_s=0.5)


def test_a_stream_whose_replica_is_killed_ends_with_an_error_and_the_cluster_serves_on(
    cluster: Server,
) -> None:
    """The replica serving a stream is killed mid-stream: the stream ends (an error event, not a hang),
    and the next requests are answered by the replica left and then by its replacement."""
    with cluster.http() as h:
        wait_until(lambda: len(h.get("/v1/stats").json()["replicas"]) == 2, timeout_s=120, interval_s=1)
        body = {"prompt": SYSTEMS[0] + " stream on", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        t0 = time.monotonic()
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            replica = r.headers[REPLICA]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(h.get("/v1/stats").json()["replicas"][replica]["pid"], signal.SIGKILL)
            rest = list(lines)  # must end: the ingress sees the replica die
        assert time.monotonic() - t0 < 60
        events = [line for line in rest if line.startswith("data: ")]
        assert any('"error"' in e for e in events), rest[-3:]  # a clear error, not a silent cut
        assert events[-1] == "data: [DONE]", rest[-3:]
        assert chat(h, SYSTEMS[1], "after the kill").status_code == 200
        assert wait_until(
            lambda: len(h.get("/v1/stats").json()["replicas"]) == 2, timeout_s=120, interval_s=1
        )
