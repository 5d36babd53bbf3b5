"""ChunkStore: prefix hash -> cached chunk (its blocks in the pool). Content matches are found
through segment_index.SegmentIndex, which points into these chunks.

Ownership: the store holds one pool ref on each block of each cached chunk. A chunk's `num_users`
counts the running requests that use it (matched it, or computed and registered it); only chunks
with no users and no pin are evictable, and only those are known to the eviction policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.eviction import POLICIES, EvictionPolicy


@dataclass
class CachedChunk:
    prefix_hash: bytes
    block_ids: list[int]
    depth: int  # chunk index within the prompt that produced it (0 = first chunk)
    num_tokens: int = 0  # chunk_size, or fewer for a prompt's tail piece (never prefix-matched)
    num_users: int = 0
    pinned: bool = False
    num_hits: int = 0


class ChunkStore:
    def __init__(self, pool: BlockPool, chunk_size: int, policy: str = "lru_freq"):
        assert chunk_size % pool.block_size == 0
        self.pool = pool
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // pool.block_size
        self.policy: EvictionPolicy = POLICIES[policy]()
        self._chunks: dict[bytes, CachedChunk] = {}
        self.num_evicted_chunks = 0
        self.num_cached_blocks = 0

    # --- lookup ----------------------------------------------------------------------------------
    def __contains__(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, prefix_hash: bytes) -> CachedChunk | None:
        return self._chunks.get(prefix_hash)

    def match_prefix(self, prefix_hashes: list[bytes]) -> list[CachedChunk]:
        """The cached chunks of the longest cached run of leading hashes (no side effects)."""
        matched: list[CachedChunk] = []
        for h in prefix_hashes:
            chunk = self._chunks.get(h)
            if chunk is None:
                break
            matched.append(chunk)
        return matched

    # --- use -------------------------------------------------------------------------------------
    def acquire(self, chunk: CachedChunk, hit: bool = True) -> None:
        """A request starts using `chunk` (the caller retains its blocks for the request)."""
        if chunk.num_users == 0:
            self.policy.remove(chunk.prefix_hash)
        chunk.num_users += 1
        if hit:
            chunk.num_hits += 1
            self.policy.touch(chunk.prefix_hash, chunk.depth)

    def release(self, prefix_hash: bytes) -> None:
        chunk = self._chunks.get(prefix_hash)
        if chunk is None:
            return
        assert chunk.num_users > 0
        chunk.num_users -= 1
        self._maybe_evictable(chunk)

    def insert(
        self, prefix_hash: bytes, block_ids: list[int], depth: int, num_tokens: int = 0
    ) -> CachedChunk:
        """Register a chunk computed by a running request, which becomes its first user.
        A tail piece (num_tokens < chunk_size) is held for content matches only."""
        num_tokens = num_tokens or self.chunk_size
        assert prefix_hash not in self._chunks and 0 < num_tokens <= self.chunk_size
        assert len(block_ids) == -(-num_tokens // self.pool.block_size)
        self.pool.retain(block_ids)
        chunk = CachedChunk(prefix_hash, list(block_ids), depth, num_tokens, num_users=1)
        self._chunks[prefix_hash] = chunk
        self.num_cached_blocks += len(block_ids)
        self.policy.touch(prefix_hash, depth)
        return chunk

    def set_pinned(self, prefix_hash: bytes, pinned: bool) -> bool:
        chunk = self._chunks.get(prefix_hash)
        if chunk is None:
            return False
        if pinned and not chunk.pinned:
            self.policy.remove(prefix_hash)
        chunk.pinned = pinned
        self._maybe_evictable(chunk)
        return True

    def _maybe_evictable(self, chunk: CachedChunk) -> None:
        if chunk.num_users == 0 and not chunk.pinned:
            self.policy.add(chunk.prefix_hash)

    # --- eviction --------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Evict chunks until `num_blocks` blocks were freed or nothing is evictable; returns blocks freed."""
        freed = 0
        while freed < num_blocks:
            victim = self.policy.pop_victim()
            if victim is None:
                break
            freed += self._drop(victim)
            self.num_evicted_chunks += 1
        return freed

    def _drop(self, prefix_hash: bytes) -> int:
        chunk = self._chunks.pop(prefix_hash)
        assert chunk.num_users == 0 and not chunk.pinned
        self.policy.forget(prefix_hash)
        self.pool.release(chunk.block_ids)
        self.num_cached_blocks -= len(chunk.block_ids)
        return sum(1 for b in chunk.block_ids if self.pool.ref_counts[b] == 0)

    # --- facts -----------------------------------------------------------------------------------
    @property
    def num_pinned_chunks(self) -> int:
        return sum(1 for c in self._chunks.values() if c.pinned)

    def chunks(self) -> list[CachedChunk]:
        return list(self._chunks.values())

    def check_integrity(self) -> None:
        assert self.num_cached_blocks == sum(len(c.block_ids) for c in self._chunks.values())
        for h, chunk in self._chunks.items():
            assert chunk.prefix_hash == h
            assert len(chunk.block_ids) == -(-chunk.num_tokens // self.pool.block_size)
            for b in chunk.block_ids:
                assert self.pool.ref_counts[b] >= 1, f"cached chunk holds free block {b}"
