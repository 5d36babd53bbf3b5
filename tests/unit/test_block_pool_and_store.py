import hashlib

import pytest

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.eviction import FrequencyAwareLRUPolicy, LRUPolicy


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def make_store(num_blocks: int = 16, policy: str = "lru_freq") -> ChunkStore:
    return ChunkStore(BlockPool(num_blocks, 4), chunk_size=8, policy=policy)


def insert_released(store: ChunkStore, i: int) -> None:
    """A request computes chunk i, registers it, then finishes."""
    blocks = store.pool.allocate(store.blocks_per_chunk)
    store.insert(h(i), blocks, depth=0)
    store.release(h(i))
    store.pool.release(blocks)


def test_pool_allocate_release_balance():
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    pool.retain(a[:1])
    pool.release(a)
    assert pool.num_free_blocks == 7
    pool.release(a[:1])
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.release(a[:1])


def test_cached_chunk_survives_request_and_is_freed_by_eviction():
    store = make_store()
    insert_released(store, 1)
    assert store.pool.num_free_blocks == 14 and len(store) == 1
    assert store.evict(2) == 2
    assert store.pool.num_free_blocks == 16 and len(store) == 0
    store.check_integrity()
    store.pool.check_integrity()


def test_pinned_and_referenced_chunks_are_never_evicted():
    store = make_store()
    for i in range(3):
        insert_released(store, i)
    store.set_pinned(h(0), True)
    chunk1 = store.get(h(1))
    assert chunk1 is not None
    store.acquire(chunk1)  # a running request uses chunk 1
    store.pool.retain(chunk1.block_ids)
    freed = store.evict(100)
    assert freed == 2 and h(0) in store and h(1) in store and h(2) not in store
    store.release(h(1))
    store.pool.release(chunk1.block_ids)
    assert store.evict(100) == 2 and h(1) not in store and h(0) in store
    store.set_pinned(h(0), False)
    assert store.evict(100) == 2 and len(store) == 0


def test_frequency_aware_policy_prefers_evicting_once_used_chunk():
    store = make_store()
    insert_released(store, 0)  # used many times, long ago
    for _ in range(5):
        chunk = store.get(h(0))
        assert chunk is not None
        store.acquire(chunk)
        store.release(h(0))
    insert_released(store, 1)  # used once, more recently
    store.evict(2)
    assert h(0) in store and h(1) not in store


def test_plain_lru_evicts_least_recent():
    store = make_store(policy="lru")
    insert_released(store, 0)
    for _ in range(5):
        chunk = store.get(h(0))
        assert chunk is not None
        store.acquire(chunk)
        store.release(h(0))
    insert_released(store, 1)
    store.evict(2)
    assert h(0) not in store and h(1) in store


def test_frequency_aware_policy_still_ages_out_old_hot_chunks():
    policy = FrequencyAwareLRUPolicy()
    policy.touch(h(0), 0)
    policy.touch(h(0), 0)  # two uses
    policy.add(h(0))
    evicted = []
    for i in range(1, 6):  # a stream of new chunks, each used once, evicted one by one
        policy.touch(h(i), 0)
        policy.add(h(i))
        evicted.append(policy.pop_victim())
    assert h(0) in evicted, "a chunk used twice must not outlive every later chunk forever"


def test_policies_skip_chunks_removed_from_the_evictable_set():
    for policy in (LRUPolicy(), FrequencyAwareLRUPolicy()):
        for i in range(3):
            policy.touch(h(i), 0)
            policy.add(h(i))
        policy.remove(h(0))
        assert policy.pop_victim() == h(1)
        assert policy.pop_victim() == h(2)
        assert policy.pop_victim() is None
