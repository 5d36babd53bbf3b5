"""ChunkRegistrar: what a sequence's computed KV adds to the cache.

Its completed chunks (prompt and generated tokens, up to its register limit: KV after a content
match is approximate and never registered) go into the chunk store, and their pieces into the
content index. While it computes prompt chunks they are marked in flight, so a sequence sharing the
prefix waits for them instead of computing them twice (Scheduler._is_deferred).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes, tail_hash
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ChunkRegistrar:
    def __init__(self, store: ChunkStore, content: ContentMatcher | None, chunk_size: int, block_size: int):
        self.store = store
        self.content = content
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.in_flight: Counter[bytes] = Counter()  # prompt chunks being computed right now
        # called with each full chunk a sequence registers, its index in the sequence's chunks (KV tiers)
        self.on_insert: list[Callable[[Sequence, CachedChunk, int], None]] = []

    def register(self, seq: Sequence) -> None:
        """Register the sequence's completed chunks (up to its register limit) and index their pieces."""
        cache = seq.cache
        num_full = seq.kv.num_computed_tokens // self.chunk_size
        if cache.register_limit is not None:
            num_full = min(num_full, cache.register_limit)
        if len(cache.prefix_hashes) < num_full:  # chunks made of generated tokens
            last = cache.prefix_hashes[-1] if cache.prefix_hashes else cache.root_hash
            cache.prefix_hashes += chunk_prefix_hashes(
                seq.token_ids[: num_full * self.chunk_size], self.chunk_size, last, len(cache.prefix_hashes)
            )
        bpc = self.store.blocks_per_chunk
        for i in range(cache.num_chunks_in_store, num_full):
            h = cache.prefix_hashes[i]
            parent = cache.prefix_hashes[i - 1] if i else None
            chunk = self.store.get(h)
            if chunk is None:
                chunk = self.store.insert(h, seq.kv.block_ids[i * bpc : (i + 1) * bpc], i, parent)
                for hook in self.on_insert:
                    hook(seq, chunk, i)
            else:
                # computed concurrently by another sequence: ours stays private, but hold the cached
                # copy so it stays the parent of the chunks this sequence registers next
                self.store.acquire(chunk, hit=False)
            cache.used_chunks.append(h)
            self._landed(seq, h)
        cache.num_chunks_in_store = max(cache.num_chunks_in_store, num_full)
        if self.content is not None:
            num_cached = cache.num_chunks_in_store * self.chunk_size
            self.content.register(seq, num_cached, cache.prefix_hashes[: cache.num_chunks_in_store])

    def register_tail(self, seq: Sequence) -> list[int]:
        """Cache the prompt's final piece shorter than a chunk (warmed documents), for content matches;
        returns its last block when this call cached it and it ends mid-block (to seal), else []."""
        full = seq.num_prompt_tokens // self.chunk_size
        tail_len = seq.num_prompt_tokens - full * self.chunk_size
        cache = seq.cache
        if (
            self.content is None
            or not self.content.enabled
            or not tail_len
            or cache.num_chunks_in_store < full
            or cache.register_limit is not None
        ):
            return []
        parent = cache.prefix_hashes[full - 1] if full else None
        tokens = seq.token_ids[full * self.chunk_size : seq.num_prompt_tokens]
        h = tail_hash(parent or cache.root_hash, tokens)
        chunk = self.store.get(h)
        open_block: list[int] = []
        if chunk is None:
            first = full * self.store.blocks_per_chunk
            blocks = seq.kv.block_ids[first : first + _cdiv(tail_len, self.block_size)]
            self.store.insert(h, blocks, full, parent, tail_len)
            open_block = blocks[-1:] if tail_len % self.block_size else []
        else:
            self.store.acquire(chunk, hit=False)
        cache.used_chunks.append(h)
        self.content.register(seq, seq.num_prompt_tokens, cache.prefix_hashes[:full] + [h])
        return open_block

    def mark_in_flight(self, seq: Sequence, hashes: list[bytes]) -> None:
        """The sequence will compute and register these chunks: twins wait for them (Scheduler._is_deferred)."""
        seq.cache.in_flight = list(hashes)
        self.in_flight.update(hashes)

    def limit(self, seq: Sequence, num_chunks: int) -> None:
        """From chunk `num_chunks` on, the sequence's KV must not be cached (it is not what its root hash
        names, e.g. computed at another weight precision): lower its register limit and stop holding
        the chunks it no longer registers in flight (twins compute them instead)."""
        cache = seq.cache
        cache.register_limit = min(
            num_chunks, cache.register_limit if cache.register_limit is not None else num_chunks
        )
        kept = set(cache.prefix_hashes[: cache.register_limit])
        for h in [h for h in cache.in_flight if h not in kept]:
            self._landed(seq, h)

    def drop_in_flight(self, seq: Sequence) -> None:
        """It leaves (finished or preempted): it will not register what it still had in flight."""
        for h in list(seq.cache.in_flight):
            self._landed(seq, h)

    def _landed(self, seq: Sequence, h: bytes) -> None:
        if h in seq.cache.in_flight:
            seq.cache.in_flight.remove(h)
            self.in_flight[h] -= 1
            if self.in_flight[h] <= 0:
                del self.in_flight[h]
