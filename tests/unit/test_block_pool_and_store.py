import hashlib

import pytest

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.eviction import FrequencyAwareLRUPolicy, LRUPolicy


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def make_store(num_blocks: int = 16, policy: str = "lru_freq") -> ChunkStore:
    return ChunkStore(BlockPool(num_blocks, 4), chunk_size=8, policy=policy)


def insert_released(store: ChunkStore, i: int, parent: int | None = None, depth: int = 0) -> None:
    """A request computes chunk i (under chunk `parent`), registers it, then finishes: the store keeps
    the allocation's ref (as KVCacheManager.commit hands it one)."""
    blocks = store.pool.allocate(store.blocks_per_chunk)
    store.insert(h(i), blocks, depth, None if parent is None else h(parent))
    store.release(h(i))


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
    assert store.pin(b"owner", [h(0)]) == 1
    chunk1 = store.get(h(1))
    assert chunk1 is not None
    store.acquire(chunk1)  # a running request uses chunk 1
    store.pool.retain(chunk1.block_ids)
    freed = store.evict(100)
    assert freed == 2 and h(0) in store and h(1) in store and h(2) not in store
    store.release(h(1))
    store.pool.release(chunk1.block_ids)
    assert store.evict(100) == 2 and h(1) not in store and h(0) in store
    assert store.unpin(b"owner") == 1 and store.unpin(b"owner") == 0
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
    policy.touch(h(0))
    policy.touch(h(0))  # two uses
    policy.add(h(0))
    evicted = []
    for i in range(1, 6):  # a stream of new chunks, each used once, evicted one by one
        policy.touch(h(i))
        policy.add(h(i))
        evicted.append(policy.pop_victim())
    assert h(0) in evicted, "a chunk used twice must not outlive every later chunk forever"


def test_policies_skip_chunks_removed_from_the_evictable_set():
    for policy in (LRUPolicy(), FrequencyAwareLRUPolicy()):
        for i in range(3):
            policy.touch(h(i))
            policy.add(h(i))
        policy.remove(h(0))
        assert policy.pop_victim() == h(1)
        assert policy.pop_victim() == h(2)
        assert policy.pop_victim() is None


def test_only_leaves_are_evicted_so_no_chunk_is_ever_orphaned():
    store = make_store(num_blocks=16)
    for i in range(4):  # one prompt's chain: 0 <- 1 <- 2 <- 3, registered in order (0 is oldest)
        blocks = store.pool.allocate(store.blocks_per_chunk)
        store.insert(h(i), blocks, i, h(i - 1) if i else None)
    for i in range(4):
        store.release(h(i))
    insert_released(store, 10, parent=1, depth=2)  # a second branch under chunk 1
    store.check_integrity()
    assert store.evict(2) == 2 and h(3) not in store and h(0) in store, (
        "the oldest chunk is the root: not first"
    )
    order = []
    while len(store):
        before = set(c.prefix_hash for c in store.chunks())
        store.evict(1)
        (gone,) = before - set(c.prefix_hash for c in store.chunks())
        order.append(gone)
        store.check_integrity()
    assert order.index(h(1)) > max(order.index(h(2)), order.index(h(10))) and order[-1] == h(0)


def test_pins_are_counted_per_owner_and_capped():
    store = ChunkStore(BlockPool(16, 4), chunk_size=8, max_pinned_blocks=6)
    for i in range(3):
        insert_released(store, i, parent=i - 1 if i else None, depth=i)
    assert store.pin(b"a", [h(0), h(1)]) == 2 and store.pin(b"b", [h(0), h(2), h(99)]) == 2
    assert store.pin(b"a", [h(0)]) == 2, "pinning again is a no-op for its owner"
    assert store.num_pinned_blocks == 6 and not store.reserve_pins(1)
    assert store.unpin(b"a") == 2
    assert store.get(h(0)).pinned and not store.get(h(1)).pinned  # type: ignore[union-attr]
    assert store.num_pinned_blocks == 4 and store.reserve_pins(2) and not store.reserve_pins(1)
    store.release_pin_reservation(2)
    store.check_integrity()
    store.evict(100)
    assert all(h(i) in store for i in range(3)), "pinned 2 keeps its unpinned parent 1 (it is not a leaf)"
    store.check_integrity()


def test_the_eviction_heap_stays_bounded_without_evictions():
    policy = FrequencyAwareLRUPolicy()
    for i in range(50):
        policy.touch(h(i))
        policy.add(h(i))
    for _ in range(2000):  # hits on evictable chunks: remove on use, add on release
        for i in range(50):
            policy.remove(h(i))
            policy.touch(h(i))
            policy.add(h(i))
    assert len(policy._heap) <= 2 * 50 + 64 + 1
