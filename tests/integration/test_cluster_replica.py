"""The cluster's pieces without Ray: an EngineReplica in this process (what a Serve replica runs),
ClusterStream over its generator, and the stats aggregation over two replicas' bodies."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import pytest

from kvserve.api.stats import with_chunk_rows
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.ingress import ClusterStream
from kvserve.cluster.replica import Accepted, EngineReplica
from kvserve.cluster.stats import cluster_stats, merge_metrics
from kvserve.config import ServeConfig
from kvserve.errors import InvalidRequestError, OverloadedError
from kvserve.metrics import Metrics
from kvserve.request import FinishReason, Request, SamplingParams

# max_queue_share 1: one submission of 2 may fill the queue (the tests below fill it on purpose)
TINY = ServeConfig(
    model="tiny-random-llama", max_cache_bytes=16 << 20, chunk_size=16, max_queue_size=2, max_queue_share=1.0
)


@pytest.fixture(scope="module")
def replica() -> Any:
    r = EngineReplica(TINY)
    yield r
    r.backend.shutdown()


def _requests(n: int, prompt: list[int], tag: str, max_tokens: int = 3) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [Request(f"{tag}-{i}", prompt, params) for i in range(n)]


def test_generate_admits_then_streams_and_refuses_before_admitting(replica: EngineReplica) -> None:
    async def run() -> None:
        gen = replica.generate(_requests(2, list(range(40)), "ok"))
        first = await gen.__anext__()
        assert first == Accepted("local")

        class Outputs:  # the DeploymentResponseGenerator surface ClusterStream uses
            async def __anext__(self) -> Any:
                return await gen.__anext__()

            def cancel(self) -> None:
                raise AssertionError("not cancelled")

        stream = ClusterStream(Outputs(), ["ok-0", "ok-1"], Metrics("m"))
        finals = [out async for out in stream if out.finished]
        assert sorted(o.request_id for o in finals) == ["ok-0", "ok-1"] and stream.finished
        assert all(len(o.token_ids) == 3 for o in finals)
        with pytest.raises(InvalidRequestError):  # more than max_queue_size at once can never run
            await replica.generate(_requests(3, [1, 2, 3], "big")).__anext__()

    asyncio.run(run())


def test_a_full_replica_refuses_before_admitting(replica: EngineReplica) -> None:
    async def run() -> None:
        # long enough that the held requests are still running when the late one comes (3 tokens of the
        # tiny model could finish first and free the queue)
        held = replica.generate(_requests(2, list(range(30)), "held", max_tokens=400))
        assert isinstance(await held.__anext__(), Accepted)
        with pytest.raises(OverloadedError):
            await replica.generate(_requests(1, [5, 6], "late")).__anext__()
        await held.aclose()  # closing aborts what is unfinished and frees the queue
        for _ in range(100):
            if replica.backend.engine.num_in_system == 0:
                break
            await asyncio.sleep(0.05)
        assert replica.backend.engine.num_in_system == 0

    asyncio.run(run())


def test_stats_sum_the_replicas_and_metrics_carry_their_label(replica: EngineReplica) -> None:
    """Serves its own request first: run alone, the replica had served nothing and the sums were 0
    (issue 62.6: it passed only after the module's other tests)."""

    async def serve() -> list[Any]:
        outputs = [out async for out in replica.generate(_requests(1, list(range(100, 140)), "stats"))]
        assert isinstance(outputs[0], Accepted) and outputs[-1].finished
        return outputs

    asyncio.run(serve())
    body = asyncio.run(replica.stats())
    assert body["replica"] == "local" and body["pid"] == os.getpid()
    other = {**body, "replica": "other", "pid": 0}
    merged = cluster_stats([body, other], Metrics("m"), ClusterConfig())
    assert merged["cluster"]["replicas"] == 2 and set(merged["replicas"]) == {"local", "other"}
    assert merged["queue"]["completed"] == 2 * body["queue"]["completed"] > 0
    assert merged["cache"]["query_tokens"] == 2 * body["cache"]["query_tokens"]
    assert merged["cache"]["hit_rate"] == pytest.approx(body["cache"]["hit_rate"])
    # what the dashboard reads: the pool's states summed, the chunk tables merged with their replica
    occupancy = body["cache"]["occupancy_blocks"]
    assert merged["cache"]["occupancy_blocks"] == {k: 2 * v for k, v in occupancy.items()}
    assert sum(occupancy.values()) == body["cache"]["blocks_total"]
    top = merged["cache"]["top_chunks"]
    assert body["cache"]["top_chunks"] and len(top) == min(10, 2 * len(body["cache"]["top_chunks"]))
    assert {r["replica"] for r in top} == {"local", "other"} or len(top) == 10
    assert set(merged["latency"]["histograms"]) == {"ttft_s", "inter_token_s"}
    name, text = asyncio.run(replica.metrics_text())
    exposition = merge_metrics({name: text, "other": text}).decode()
    for label in ('replica="local"', 'replica="other"'):
        assert label in exposition
    assert exposition.count("# TYPE kvserve:request_success_total counter") == 1


def test_the_ingress_withholds_every_replicas_chunk_rows(replica: EngineReplica) -> None:
    """Issue 62.5: what /v1/stats withholds from a caller (kvserve.api.stats.with_chunk_rows, run by
    the route the ingress serves too) goes from the merged table and from each replica's own body."""

    async def serve() -> None:  # chunks to list, whichever tests ran before
        outputs = [out async for out in replica.generate(_requests(1, list(range(200, 240)), "rows"))]
        assert outputs[-1].finished

    asyncio.run(serve())
    body = asyncio.run(replica.stats())
    other = copy.deepcopy({**body, "replica": "other"})
    merged = cluster_stats([body, other], Metrics("m"), ClusterConfig())
    assert merged["cache"]["top_chunks"] and all(
        r["cache"]["top_chunks"] for r in merged["replicas"].values()
    )
    hidden = with_chunk_rows(merged, "the per-chunk rows need the admin key")
    for cache in [hidden["cache"], *(r["cache"] for r in hidden["replicas"].values())]:
        assert (
            cache["top_chunks"] == []
            and cache["top_chunks_withheld"] == "the per-chunk rows need the admin key"
        )


def test_an_aborted_stream_leaves_nothing_in_the_ingress_metrics(replica: EngineReplica) -> None:
    """Issue 32.7: ClusterStream.abort cancelled the generator, whose final outputs then never came,
    so the metrics kept every cancelled request id (`_last_token_time`) for good."""

    async def run() -> None:
        gen = replica.generate(
            [Request("long-0", list(range(20)), SamplingParams(max_tokens=200, ignore_eos=True))]
        )
        assert isinstance(await gen.__anext__(), Accepted)
        cancelled = []

        class Outputs:
            async def __anext__(self) -> Any:
                return await gen.__anext__()

            def cancel(self) -> None:
                cancelled.append(True)

        metrics = Metrics("m")
        stream = ClusterStream(Outputs(), ["long-0"], metrics)
        async for out in stream:
            if out.new_token_ids:
                break
        assert metrics._last_token_time  # a token seen: the id is tracked
        stream.abort()
        await gen.aclose()
        assert cancelled and stream.finished and not metrics._last_token_time

    asyncio.run(run())


def test_requests_failed_at_shutdown_leave_nothing_in_the_metrics() -> None:
    """Issue 32.7: the local AsyncEngine's _fail_all (a drain past its grace) finished streams without
    telling the metrics observer, which then kept those request ids."""
    from kvserve.config import ServeConfig
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.engine import Engine

    config = ServeConfig(model="tiny-random-llama", max_cache_bytes=16_000_000)
    metrics = Metrics("m")
    engine = AsyncEngine(Engine(config), config.max_queue_size, observer=metrics.observe)
    engine.start()

    async def run() -> None:
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        stream = await engine.submit([Request("forever", list(range(30)), params)])
        async for out in stream:
            if out.new_token_ids:
                break
        assert metrics._last_token_time
        await engine.drain(grace_s=0.0)  # past the grace: every routed request fails
        finals = [out async for out in stream if out.finished]
        assert finals and finals[-1].finish_reason == FinishReason.ERROR
        assert not metrics._last_token_time

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
