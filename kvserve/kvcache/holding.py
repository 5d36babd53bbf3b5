"""A request's hold on the KV cache (Holding), what `reserve` holds for an admission (Reservation),
what a commit inserted (Committed), and the books they must agree with (check_holdings)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.chunk_store import ChunkStore


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Holding:
    """One request's hold on the cache, from admission until it finishes or is preempted."""

    # per layer group (kvcache/layout.py), the blocks in position order, one pool ref each; -1: a
    # sliding group's block that left the window (given back)
    tables: list[list[int]] = field(default_factory=list)
    used_chunks: list[bytes] = field(default_factory=list)  # cached chunks it is a user of
    num_chunks_in_store: int = 0  # leading chunks cached and held (matched, registered or adopted)
    in_flight: list[bytes] = field(default_factory=list)  # prompt chunks it computes and will register
    register_limit: int | None = None  # chunks from this index on hold approximate KV: never registered
    num_committed_tokens: int = 0  # the latest `commit`'s num_computed (`slide` comes after it)


@dataclass
class Reservation:
    """What `reserve` held for one admission: `admit` takes it, once."""

    chunks: list[bytes]  # the held chunks' prefix hashes: matched, sources, the partial hit's
    num_new_blocks: int
    admitted: bool = False


@dataclass(frozen=True)
class Committed:
    """A full chunk a commit inserted into the store, at `index` among the request's chunks."""

    chunk: CachedChunk
    index: int


def landed(in_flight: Counter[bytes], held: Holding, h: bytes) -> None:
    """The request registered chunk `h`, or no longer will: twins stop waiting on it for this one."""
    if h in held.in_flight:
        held.in_flight.remove(h)
        in_flight[h] -= 1
        if in_flight[h] <= 0:
            del in_flight[h]


def check_holdings(
    pool: BlockPool,
    store: ChunkStore,
    held: dict[str, Holding],
    in_flight: Counter[bytes],
    admitted: list[str],
) -> None:
    """Ownership (invariant 3) over every holding; `admitted`: the request ids that should hold
    something (the running sequences)."""
    pool.check_integrity()
    store.check_integrity()
    assert set(held) <= set(admitted), "a request that is not running holds cache"
    expected = [0] * pool.num_blocks
    for h in held.values():
        assert len({len(t) for t in h.tables}) == 1, "layer groups' tables of different lengths"
        for b in (b for t in h.tables for b in t if b >= 0):
            expected[b] += 1
    for chunk in store.chunks():
        for b in chunk.all_block_ids:
            expected[b] += 1
    assert expected == pool.ref_counts, "pool ref counts do not match owners"
    users = Counter(c for h in held.values() for c in h.used_chunks)
    for chunk in store.chunks():
        assert chunk.num_users == users.get(chunk.prefix_hash, 0), "chunk user count mismatch"
    flying = Counter(c for h in held.values() for c in h.in_flight)
    assert flying == in_flight, "in-flight chunks do not match the holdings"
