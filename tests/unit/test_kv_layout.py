"""Sliding-window layers in the pool (kvcache/layout.py): layer groups, a request's sliding groups
giving back the blocks that leave the window, chunks keeping their sliding parts until memory is
short, and prefix hits that end where those parts are missing. The ownership invariant is checked
after every verb."""

from __future__ import annotations

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes
from kvserve.kvcache.layout import KVLayout
from kvserve.kvcache.manager import KVCacheManager

ROOT = b"r" * 32
BS = 4
CHUNK = 8  # 2 blocks
WINDOW = 6  # a row at p reads (p - 6, p]
GEMMA3_270M = ["s"] * 5 + ["f"]


def test_layers_are_cut_into_groups_of_one_size():
    layout = KVLayout.of([None if t == "f" else 512 for t in GEMMA3_270M * 3])
    assert [g.layers for g in layout.groups] == [
        (5, 11, 17),
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
    ]
    assert [g.window for g in layout.groups] == [None] + [512] * 5
    assert layout.num_slots == 3 and layout.num_full_groups == 1
    assert (layout.group_of(11), layout.slot_of(11)) == (0, 1)
    assert (layout.group_of(6), layout.slot_of(6)) == (2, 2)
    assert not KVLayout.of([None] * 4).windowed and KVLayout.of([None] * 4).num_slots == 4
    assert KVLayout.of([8] * 4).num_groups == 1 and KVLayout.of([8] * 4).windowed  # every layer slides


def test_a_sliding_group_holds_its_window_and_the_global_one_everything():
    layout = KVLayout.of([WINDOW, None])  # one layer each: two groups of one layer
    # after 20 tokens the next row (position 20) reads 15..20: blocks 3 on (4 tokens each)
    assert layout.first_needed_block(0, 20, BS) == 0 and layout.first_needed_block(1, 20, BS) == 3
    assert layout.held_blocks(20, BS) == 5 + 2
    # a step of 8 rows from position 20 reads from 15 and writes up to 27: blocks 3..6
    assert layout.max_blocks(1000, BS, 8) == 250 + (-(-(WINDOW - 1 + 8) // BS) + 1)
    assert layout.max_blocks(4, BS, 8) == 2  # a short request: every block, each group


def make(num_blocks: int = 40) -> KVCacheManager:
    pool = BlockPool(num_blocks, BS)
    layout = KVLayout.of([WINDOW, None])
    return KVCacheManager(pool, ChunkStore(pool, CHUNK, layout=layout), layout)


def hashes(tokens: list[int]) -> list[bytes]:
    return chunk_prefix_hashes(tokens, CHUNK, ROOT)


def run(kv: KVCacheManager, rid: str, tokens: list[int], step: int = 4) -> list[bytes]:
    """A request computes `tokens` after its prefix hit, `step` rows at a time, committing and
    sliding after each step as the scheduler's registrar does."""
    hs = hashes(tokens)
    matched = kv.match(hs)
    done = len(matched) * CHUNK
    r = kv.reserve(matched, 0)
    assert r
    kv.admit(rid, r, matched, [])
    while done < len(tokens):
        done = min(done + step, len(tokens))
        assert kv.grow(rid, done)
        kv.commit(rid, tokens, done, hs, ROOT)
        kv.slide(rid, done)
        kv.check_integrity([rid])
    return hs


def test_sliding_blocks_go_back_as_the_window_moves():
    kv = make()
    run(kv, "a", list(range(40)))
    full, sliding = kv.block_tables("a")
    assert len(full) == len(sliding) == 10 and -1 not in full
    # the next row (position 40) reads 35..40: blocks 8 and 9; everything before was given back
    assert sliding[:8] == [-1] * 8 and -1 not in sliding[8:]
    # the store kept every chunk's sliding part (nothing asked for room): 5 chunks x 2 groups x 2 blocks
    assert kv.store.num_cached_blocks == 20
    kv.free("a")
    kv.check_integrity([])
    assert kv.pool.num_free_blocks == 40 - 20


def test_short_of_room_the_sliding_parts_go_before_any_chunk():
    kv = make(num_blocks=24)
    hs = run(kv, "a", list(range(40)))
    kv.free("a")
    assert kv.pool.num_free_blocks == 4
    assert kv.make_room(12)  # 8 more: the oldest sliding parts, not whole chunks
    kv.check_integrity([])
    assert len(kv.store) == 5 and kv.store.num_windows_dropped == 4
    assert len(kv.match(hs)) == 5  # a hit of all 5 reads only the last chunk's sliding part
    kept = [bool(kv.store.get(h).window_blocks) for h in hs]  # type: ignore[union-attr]
    assert kept == [False] * 4 + [True]


def test_a_hit_ends_where_the_sliding_parts_before_it_are_missing():
    kv = make()
    tokens = list(range(40))
    hs = run(kv, "a", tokens)
    kv.free("a")
    assert len(kv.match(hs[:4])) == 4  # every part still there
    kv.store.drop_windows(100, keep=set())
    kv.check_integrity([])
    # a hit of n chunks needs the sliding part of the chunk ending at n (its last WINDOW - 1 tokens)
    assert kv.match(hs) == []
    # the one that recomputes it gives the chunks their sliding parts back
    run(kv, "b", tokens)
    kv.free("b")
    kv.check_integrity([])
    assert len(kv.match(hs)) == 5


def test_a_hit_shares_only_the_window_of_the_sliding_group():
    kv = make()
    tokens = list(range(40))
    hs = run(kv, "a", tokens)
    kv.free("a")
    matched = kv.match(hs[:3])  # 24 tokens: the next row reads 19..24, blocks 4 and 5
    r = kv.reserve(matched, 1)
    assert r
    kv.admit("b", r, matched, [])
    full, sliding = kv.block_tables("b")
    assert full[:6] == [b for c in matched for b in c.block_ids]
    assert sliding[:4] == [-1] * 4 and sliding[4:6] == matched[2].window_blocks
    kv.check_integrity(["b"])
    # a sliding part a running request reads is never dropped
    kv.store.drop_windows(100, keep=set())
    assert matched[2].window_blocks and not matched[0].window_blocks
    kv.check_integrity(["b"])


def test_an_import_fills_every_group():
    kv = make()
    hs = hashes(list(range(8)))
    written: list[list[list[int]]] = []
    chunk = kv.import_chunk(hs[0], 0, None, written.append)
    assert chunk is not None
    (groups,) = written
    assert groups == [chunk.block_ids, chunk.window_blocks] and len(groups[0]) == 2
    kv.check_integrity([])
    assert kv.chunk_group_blocks(chunk) == groups
