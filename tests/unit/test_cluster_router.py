"""The Ray Serve request router (kvserve/cluster/router.py) on stand-ins for Serve's replicas and
pending requests: ranking, slots that survive a replacement, the X-KVServe-Replica ask, round-robin,
bounded load from Serve's queue lengths, and the decision counts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from kvserve.cluster import routing  # noqa: E402
from kvserve.cluster.router import PrefixAffinityRouter  # noqa: E402


@dataclass(frozen=True)
class ReplicaID:
    unique_id: str


@dataclass(frozen=True)
class Replica:
    replica_id: ReplicaID


@dataclass
class Metadata:
    internal_request_id: str


@dataclass
class Pending:
    kwargs: dict[str, Any]
    metadata: Metadata = field(default_factory=lambda: Metadata("r"))


class Loads(dict):  # Serve's ReplicaQueueLengthCache surface: get(replica_id)
    pass


def router(**kwargs: Any) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    r.initialize_state(**kwargs)
    r._replica_queue_len_cache = Loads()  # type: ignore[assignment]
    return r


def replicas(*ids: str) -> list[Replica]:
    return [Replica(ReplicaID(i)) for i in ids]


def choose(r: PrefixAffinityRouter, live: list[Replica], **kwargs: Any) -> list[list[Replica]]:
    return asyncio.run(r.choose_replicas(live, Pending(kwargs)))  # type: ignore[arg-type]


def first(ranks: list[list[Replica]]) -> str:
    return ranks[0][0].replica_id.unique_id


KEYS = [bytes([i]) * 32 for i in range(40)]


def test_a_key_keeps_its_replica_and_the_others_come_next() -> None:
    r = router()
    live = replicas("a", "b", "c")
    for key in KEYS:
        ranks = choose(r, live, affinity_key=key)
        assert [len(rank) for rank in ranks] == [1, 2]
        assert first(choose(r, live, affinity_key=key)) == first(ranks)
    assert len({first(choose(r, live, affinity_key=k)) for k in KEYS}) == 3


def test_a_replacement_takes_the_dead_replicas_slot_and_keys() -> None:
    r = router()
    before = {k: first(choose(r, replicas("a", "b"), affinity_key=k)) for k in KEYS}
    after = {k: first(choose(r, replicas("a", "z"), affinity_key=k)) for k in KEYS}  # b died, z came
    assert {k for k in KEYS if before[k] == "a"} == {k for k in KEYS if after[k] == "a"}
    assert all(after[k] == "z" for k in KEYS if before[k] == "b")
    # the same ids in another order, or other ids altogether, place keys the same way (slots)
    fresh = {k: first(choose(router(), replicas("q", "p"), affinity_key=k)) for k in KEYS}
    assert [fresh[k] == "p" for k in KEYS] == [before[k] == "a" for k in KEYS]


def test_asked_round_robin_and_no_key() -> None:
    r = router()
    live = replicas("a", "b")
    assert all(first(choose(r, live, affinity_key=k, replica="b")) == "b" for k in KEYS[:5])
    assert first(choose(r, live, affinity_key=KEYS[0], replica="gone")) in {"a", "b"}
    r._replica_queue_len_cache.update({ReplicaID("a"): 3})
    assert first(choose(r, live, affinity_key=None)) == "b"  # no key: the least loaded
    rr = router(routing="round-robin")
    assert [first(choose(rr, live, affinity_key=KEYS[0])) for _ in range(4)] == ["b", "a", "b", "a"]


def test_bounded_load_moves_a_request_off_an_overloaded_replica() -> None:
    r = router(load_factor=1.5, min_load=2)
    live = replicas("a", "b")
    key = next(k for k in KEYS if first(choose(r, live, affinity_key=k)) == "a")
    r._replica_queue_len_cache.update({ReplicaID("a"): 4, ReplicaID("b"): 0})
    assert first(choose(r, live, affinity_key=key)) == "b"
    r._replica_queue_len_cache.update({ReplicaID("a"): 4, ReplicaID("b"): 3})
    assert first(choose(r, live, affinity_key=key)) == "a"


def test_decisions_are_counted_when_serve_routes() -> None:
    r = router()
    live = replicas("a", "b")
    before = routing.decisions()
    for i, key in enumerate(KEYS[:4]):
        pending = Pending({"affinity_key": key}, Metadata(f"req-{i}"))
        chosen = asyncio.run(r.choose_replicas(live, pending))  # type: ignore[arg-type]
        other = chosen[1][0] if i == 3 else chosen[0][0]  # the last one: Serve took the second rank
        r.on_request_routed(pending, other.replica_id, None)  # type: ignore[arg-type]
    after = routing.decisions()
    assert after.get("affinity", 0) - before.get("affinity", 0) == 3
    assert after.get("fallback", 0) - before.get("fallback", 0) == 1
