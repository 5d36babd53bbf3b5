"""The KV cache's facts as /v1/stats reports them: the pool's blocks by state and the chunk store's
counters and most reused chunks (`KVCacheManager.stats`). One pass over the cached chunks: the
caller bounds how often it runs."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    num_free_blocks: int
    # held only by cached chunks that nothing uses and nothing pins: eviction frees them on demand
    num_evictable_blocks: int
    block_size: int
    pool_tokens: int

    @property
    def num_used_blocks(self) -> int:
        """Blocks off the free list (running requests plus every cached chunk)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the share of blocks not available to new work (evictable
        cached blocks count as free)."""
        busy = self.num_blocks - self.num_free_blocks - self.num_evictable_blocks
        return busy / self.num_blocks if self.num_blocks else 0.0


TOP_CHUNKS = 10  # rows of the chunk table /v1/stats and the dashboard show


@dataclass(frozen=True)
class ChunkRow:
    """A cached chunk as the stats show it: its hash and counters, never its tokens."""

    chunk_hash: str  # the prefix hash's first 16 hex digits
    depth: int  # its index in the prompts that share it (0: the first chunk)
    num_tokens: int
    prefix_tokens: int  # tokens from the prompt's start through this chunk
    num_hits: int  # requests that reused it
    pinned: bool
    tier: str  # where its KV is: the hot pool (lower tiers are listed per tier, not per chunk)
    origin: str  # computed here, or the tier it was loaded from
    last_used: float  # time.monotonic() of its last use (a stable value: stats compare equal)


@dataclass(frozen=True)
class StoreStats:
    num_chunks: int
    num_cached_blocks: int
    num_pinned_chunks: int
    num_pinned_blocks: int
    max_pinned_blocks: int  # --max-pinned-fraction of the pool
    num_pin_owners: int  # warmed texts holding pins
    cached_bytes: int
    max_cache_bytes: int
    num_evicted_chunks: int
    num_chunk_hits: int  # acquisitions of cached chunks by requests that reuse them
    top_chunks: tuple[ChunkRow, ...] = ()  # the most reused (TOP_CHUNKS), then the most recent


def cache_stats(
    pool: BlockPool, store: ChunkStore, bytes_per_block: float, max_cache_bytes: int
) -> tuple[PoolStats, StoreStats]:
    pool_stats = PoolStats(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_evictable_blocks=num_evictable_blocks(pool, store),
        block_size=pool.block_size,
        pool_tokens=pool.num_blocks * pool.block_size,
    )
    store_stats = StoreStats(
        num_chunks=len(store),
        num_cached_blocks=store.num_cached_blocks,
        num_pinned_chunks=store.num_pinned_chunks,
        num_pinned_blocks=store.num_pinned_blocks,
        max_pinned_blocks=store.max_pinned_blocks,
        num_pin_owners=store.num_pin_owners,
        cached_bytes=int(store.num_cached_blocks * bytes_per_block),
        max_cache_bytes=max_cache_bytes,
        num_evicted_chunks=store.num_evicted_chunks,
        num_chunk_hits=store.num_chunk_hits,
        top_chunks=top_chunks(store),
    )
    return pool_stats, store_stats


def num_evictable_blocks(pool: BlockPool, store: ChunkStore) -> int:
    """Blocks whose every owner is a cached chunk that eviction can reclaim: no running user, not
    pinned, and no used or pinned chunk below it (only leaves are evicted, so such a descendant keeps
    its ancestors); and the sliding-window parts of unpinned chunks that no request reads."""
    kept: set[bytes] = set()
    for chunk in store.chunks():
        h: bytes | None = chunk.prefix_hash if chunk.num_users or chunk.pinned else None
        while h is not None and h not in kept:
            kept.add(h)
            parent = store.get(h)
            h = parent.parent if parent is not None else None
    holders: Counter[int] = Counter()
    for chunk in store.chunks():
        if chunk.prefix_hash not in kept:
            holders.update(chunk.all_block_ids)
        elif not chunk.pinned:  # a sliding-window part is dropped on its own (ChunkStore.drop_windows)
            holders.update(chunk.window_blocks)
    ref_counts = pool.ref_counts
    return sum(1 for block, n in holders.items() if ref_counts[block] == n)


def top_chunks(store: ChunkStore) -> tuple[ChunkRow, ...]:
    chunks = heapq.nlargest(TOP_CHUNKS, store.chunks(), key=lambda c: (c.num_hits, c.last_used))
    return tuple(
        ChunkRow(
            chunk_hash=c.prefix_hash.hex()[:16],
            depth=c.depth,
            num_tokens=c.num_tokens,
            prefix_tokens=c.depth * store.chunk_size + c.num_tokens,
            num_hits=c.num_hits,
            pinned=c.pinned,
            tier="hot",
            origin=c.origin,
            last_used=c.last_used,
        )
        for c in chunks
    )
