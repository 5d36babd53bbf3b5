"""kvserve/cluster/routing.py: affinity keys are the engine's prefix hashes, the ring spreads and
keeps keys, bounded load overrides affinity only for an overloaded replica."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.cluster.routing import PrefixRouter, affinity_key
from kvserve.kvcache.hashing import chunk_prefix_hashes, root_hash

NS = "model|tok|bf16|chunk=128|block=16"


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def test_key_is_the_engines_prefix_hash_of_the_first_chunks():
    ids = prompt(1)
    hashes = chunk_prefix_hashes(ids, 128, root_hash(NS, None))
    assert affinity_key(ids, NS, 128) == hashes[0]
    assert affinity_key(ids, NS, 128, affinity_chunks=2) == hashes[1]
    assert affinity_key(ids[:127], NS, 128) is None  # shorter than a chunk: nothing to reuse
    assert affinity_key(ids, NS, 128, affinity_chunks=3) is None  # 300 tokens: 2 full chunks


def test_key_depends_on_the_first_chunks_salt_and_namespace_only():
    system = prompt(2, 128)
    a, b = system + prompt(3, 50), system + prompt(4, 90)
    assert affinity_key(a, NS, 128) == affinity_key(b, NS, 128)  # same system prompt, other question
    assert affinity_key(a, NS, 128, cache_salt="tenant-1") != affinity_key(a, NS, 128)
    assert affinity_key(a, NS + "x", 128) != affinity_key(a, NS, 128)
    assert affinity_key(prompt(5, 128) + prompt(3, 50), NS, 128) != affinity_key(a, NS, 128)


def test_same_key_same_replica_and_keys_spread_over_replicas():
    router = PrefixRouter([f"r{i}" for i in range(4)])
    keys = [affinity_key(prompt(100 + i, 128), NS, 128) for i in range(2000)]
    assert all(k is not None for k in keys)
    placed = [router.route(k, {}).replica for k in keys]
    assert placed == [router.route(k, {}).replica for k in keys]  # deterministic
    counts = Counter(placed)
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert max(counts.values()) < 1.5 * min(counts.values()), counts  # 64 points each: roughly even


def test_removing_a_replica_moves_only_its_keys_and_adding_one_moves_about_one_in_n():
    router = PrefixRouter(["a", "b", "c", "d"])
    keys = [prompt(i, 8).__repr__().encode() for i in range(3000)]
    before = {k: router.preferred(k) for k in keys}
    router.remove("c")
    after = {k: router.preferred(k) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")
    assert all(after[k] != "c" for k in keys)
    router.add("e")
    moved = sum(router.preferred(k) != after[k] for k in keys)
    assert 0.1 < moved / len(keys) < 0.4  # about 1/4 of the keys move to the new replica


def test_bounded_load_sends_an_overloaded_replicas_requests_to_the_least_loaded():
    router = PrefixRouter(["a", "b"], load_factor=1.5, min_load=2)
    key = next(k for k in (bytes([i]) * 32 for i in range(256)) if router.preferred(k) == "a")
    assert router.route(key, {"a": 1, "b": 0}).replica == "a"  # under min_load: affinity
    assert router.route(key, {"a": 2, "b": 2}).reason == "affinity"  # balanced
    r = router.route(key, {"a": 4, "b": 1})  # 4 > 1.5 x mean 2.5
    assert (r.replica, r.preferred, r.reason) == ("b", "a", "overloaded")
    assert router.route(key, {"a": 3, "b": 2}).replica == "a"  # 3 <= 1.5 x 2.5


def test_no_key_goes_to_the_least_loaded_and_no_replica_is_an_error():
    router = PrefixRouter(["a", "b", "c"])
    assert router.route(None, {"a": 3, "b": 1, "c": 2}).replica == "b"
    assert router.route(None, {}).replica == "a"  # ties: ring order of addition
    with pytest.raises(LookupError):
        PrefixRouter([]).route(b"k" * 32, {})
    with pytest.raises(ValueError):
        router.add("a")
    with pytest.raises(ValueError):
        PrefixRouter(["a"], load_factor=0.5)
