"""KVCacheManager's books: holdings keyed by request id, shared prefix blocks, commits, eviction for
room, tier imports, and the ownership invariant after each verb."""

from __future__ import annotations

import pytest

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes
from kvserve.kvcache.manager import KVCacheManager

ROOT = b"r" * 32
CHUNK = 8  # 2 blocks of 4


def make(num_blocks: int = 16) -> KVCacheManager:
    pool = BlockPool(num_blocks, 4)
    return KVCacheManager(pool, ChunkStore(pool, CHUNK))


def hashes(tokens: list[int]) -> list[bytes]:
    return chunk_prefix_hashes(tokens, CHUNK, ROOT)


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[bytes]:
    """A request with no cache hit computes `tokens` and commits its full chunks."""
    hs = hashes(tokens)
    r = kv.reserve([], -(-len(tokens) // 4))
    assert r
    kv.admit(rid, r, [], [])
    kv.commit(rid, tokens, len(tokens), hs, ROOT)
    return hs


def test_a_second_request_shares_the_committed_prefix():
    kv = make()
    tokens = list(range(20))  # 2 full chunks + 4 tokens
    hs = compute(kv, "a", tokens)
    kv.check_integrity(["a"])
    assert len(kv.store) == 2 and kv.holding("a").num_chunks_in_store == 2
    matched = kv.match(hs)
    assert [c.prefix_hash for c in matched] == hs
    r = kv.reserve(matched, 1)
    assert r
    kv.admit("b", r, matched, [])
    assert kv.block_ids("b")[:4] == kv.block_ids("a")[:4] and kv.block_ids("b")[4] != kv.block_ids("a")[4]
    kv.check_integrity(["a", "b"])
    kv.free("a")
    kv.free("b")
    kv.check_integrity([])
    assert kv.num_free_blocks == 16 - 4  # the two cached chunks stay
    assert kv.block_ids("a") == []


def test_grow_evicts_unused_chunks_and_says_no_when_it_cannot():
    kv = make(num_blocks=8)
    compute(kv, "a", list(range(16)))  # 4 blocks, 2 chunks cached
    kv.free("a")
    assert kv.num_free_blocks == 4
    kv.admit("b", kv.reserve([], 0), [], [])
    assert kv.grow("b", 32)  # 8 blocks: evicts both chunks
    assert len(kv.store) == 0 and len(kv.block_ids("b")) == 8
    assert not kv.grow("b", 36)  # a ninth block does not exist
    assert len(kv.block_ids("b")) == 8
    kv.check_integrity(["b"])


def test_reserve_undoes_its_holds_when_the_blocks_are_not_there():
    kv = make(num_blocks=8)
    hs = compute(kv, "a", list(range(16)))
    matched = kv.match(hs)
    assert not kv.reserve(matched, 5)  # 4 free; the matched chunks are in use by "a": not evictable
    assert all(c.num_users == 1 for c in matched)
    kv.check_integrity(["a"])


def test_in_flight_and_limit():
    kv = make()
    tokens = list(range(24))
    hs = hashes(tokens)
    kv.admit("a", kv.reserve([], 6), [], [])
    kv.mark_in_flight("a", hs)
    assert kv.in_flight == {h: 1 for h in hs}
    kv.limit("a", hs, 1)  # from chunk 1 on its KV is approximate: not registered, not in flight
    assert set(kv.in_flight) == {hs[0]}
    kv.commit("a", tokens, 24, hs, ROOT)
    assert len(kv.store) == 1 and not kv.in_flight
    kv.free("a")
    kv.check_integrity([])


def test_import_needs_its_parent_and_leaves_the_chunk_unused():
    kv = make()
    hs = hashes(list(range(16)))
    written: list[list[int]] = []
    assert kv.import_chunk(hs[1], 1, hs[0], written.append) is None  # parent not cached
    chunk = kv.import_chunk(hs[0], 0, None, written.append)
    assert chunk is not None and chunk.num_users == 0 and chunk.evictable
    assert written == [[chunk.block_ids]]  # one layer group
    assert kv.import_chunk(hs[1], 1, hs[0], written.append) is not None
    kv.check_integrity([])
    assert kv.store.evict(100) == 4 and kv.num_free_blocks == 16


def test_a_prompt_sharing_a_cached_chunks_first_blocks_reuses_them():
    kv = make()
    a = list(range(16))  # 2 chunks of 2 blocks
    compute(kv, "a", a)
    chunk_a1 = kv.store.get(hashes(a)[1])
    assert chunk_a1 is not None and len(chunk_a1.block_keys) == 1  # its first block (of 2)
    b = a[:12] + [99, 98, 97, 96, 95]  # chunk 1 shares its first block (tokens 8..11) with a's
    hb = hashes(b)
    matched = kv.match(hb)
    assert [c.prefix_hash for c in matched] == hashes(a)[:1]
    partial = kv.match_blocks(hb, b, len(matched), ROOT, max_tokens=len(b) - 1)
    assert partial == (chunk_a1, 1)
    assert kv.match_blocks(hb, b, len(matched), ROOT, max_tokens=11) is None  # needs 12 tokens
    r = kv.reserve([*matched, chunk_a1], 3)
    assert r
    kv.admit("b", r, matched, [], partial)
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    kv.commit("b", b, len(b), hb, ROOT)  # b's chunk 1 holds a's block and one of its own
    kv.check_integrity(["a", "b"])
    assert kv.store.num_cached_blocks == 5  # the shared block counts once
    kv.free("a")
    kv.free("b")
    kv.check_integrity([])
    kv.store.evict(16)
    kv.check_integrity([])
    assert len(kv.store) == 0 and kv.pool.num_free_blocks == 16


def test_a_requests_whole_blocks_past_its_last_full_chunk_are_cached_block_by_block():
    kv = make()
    a = list(range(22))  # 2 chunks (16 tokens), then 1 whole block (16..19) and 2 tokens
    hs = compute(kv, "a", a)
    assert (
        kv.commit_blocks("a", a, 15, hs, ROOT) is None
    )  # computed inside chunk 1: no whole block past a chunk
    tail = kv.commit_blocks("a", a, len(a), hs, ROOT)
    assert tail is not None and tail.num_tokens == 4 and tail.block_ids == kv.block_ids("a")[4:5]
    assert tail.parent == hs[1] and tail.depth == 2 and len(tail.block_keys) == 1
    assert kv.commit_blocks("a", a, len(a), hs, ROOT) is None  # its block is findable already
    kv.check_integrity(["a"])
    kv.free("a")
    kv.check_integrity([])
    b = a[:20] + [99, 98]  # shares a's 2 chunks and its whole block after them
    hb = hashes(b)
    matched = kv.match(hb)
    assert [c.prefix_hash for c in matched] == hs
    assert kv.match_blocks(hb, b, len(matched), ROOT, max_tokens=len(b) - 1) == (tail, 1)
    assert kv.store.evict(16) == 5 and kv.num_free_blocks == 16  # the tail first (a leaf), then the chunks
    kv.check_integrity([])


def test_blocks_past_a_register_limit_are_not_cached():
    kv = make()
    a = list(range(22))
    hs = compute(kv, "a", a)
    kv.limit("a", hs, 1)  # from chunk 1 on the KV is not what the hashes name
    assert kv.commit_blocks("a", a, len(a), hs, ROOT) is None
    kv.free("a")
    kv.check_integrity([])


def test_a_full_chunk_takes_the_block_keys_of_a_tail_it_extends():
    """A block tail's keys move to a full chunk with the same leading blocks, so evicting the tail (a
    leaf, evicted first) does not take away the full chunk's block hits."""
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool, ChunkStore(pool, CHUNK, policy="lru"))
    a = list(range(20))  # 2 chunks and one whole block
    hs = compute(kv, "a", a)
    tail = kv.commit_blocks("a", a, len(a), hs, ROOT)
    assert tail is not None and len(tail.block_keys) == 1
    kv.free("a")
    b = a + [50, 51, 52, 53]  # a's prompt and one more block: chunk 2 fills
    hb = hashes(b)
    matched = kv.match(hb)
    assert kv.match_blocks(hb, b, len(matched), ROOT, max_tokens=len(b) - 1) == (tail, 1)
    r = kv.reserve(matched, 2)  # b computes chunk 2 itself (as one admitted beside a would)
    assert r
    kv.admit("b", r, matched, [])
    kv.commit("b", b, len(b), hb, ROOT)
    full = kv.store.get(hb[2])
    assert full is not None and len(full.block_keys) == 1 and tail.block_keys == []
    kv.free("b")
    kv.check_integrity([])
    assert kv.store.evict(1) == 1  # the tail goes first (released before b's chunk 2), its block with it
    assert kv.store.get(tail.prefix_hash) is None
    assert kv.match_blocks(hb, b[:20] + [9, 9, 9], len(matched), ROOT, max_tokens=22) == (full, 1)
    kv.check_integrity([])


def test_the_verbs_order_is_enforced():
    """Out of order, a verb raises (the manager's checks are assertions): an admission without the
    reservation it was made for or with one already used, a request's verbs before admit or after
    free, a slide before the commit of its tokens."""
    kv = make()
    tokens = list(range(20))
    hs = compute(kv, "a", tokens)
    with pytest.raises(AssertionError, match="commit b: it is not admitted"):
        kv.commit("b", tokens, len(tokens), hs, ROOT)
    matched = kv.match(hs)
    r = kv.reserve(matched, 1)
    assert r
    with pytest.raises(AssertionError, match="not the chunks `reserve` held"):
        kv.admit("b", r, [], [])
    kv.admit("b", r, matched, [])
    with pytest.raises(AssertionError, match="reservation was admitted already"):
        kv.admit("c", r, matched, [])
    with pytest.raises(AssertionError, match="slide b to 20 tokens before their commit"):
        kv.slide("b", len(tokens))
    kv.commit("b", tokens, len(tokens), list(hs), ROOT)
    kv.slide("b", len(tokens))
    kv.free("b")
    with pytest.raises(AssertionError, match="grow b: it is not admitted"):
        kv.grow("b", 24)
    kv.check_integrity(["a"])
