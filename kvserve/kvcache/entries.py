"""CacheEntries: what enters the chunk store, under the KVCacheManager (which holds the requests'
books and calls these with the request's Holding): a request's completed chunks (`commit`), a
warm's tail (`commit_tail`), the whole blocks after its last chunk (`commit_blocks`), a chunk
loaded from a KV tier (`import_chunk`), and room made for new blocks (`make_room`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import block_keys, blocks_hash, chunk_prefix_hashes, tail_hash
from kvserve.kvcache.holding import Committed, Holding, cdiv, landed
from kvserve.kvcache.layout import KVLayout


class CacheEntries:
    def __init__(self, pool: BlockPool, store: ChunkStore, layout: KVLayout, in_flight: Counter[bytes]):
        self.pool, self.store, self.in_flight = pool, store, in_flight
        self.num_groups, self.num_full_groups = layout.num_groups, layout.num_full_groups
        self.windowed = layout.windowed
        self.block_size, self.chunk_size = pool.block_size, store.chunk_size
        self.blocks_per_chunk = store.blocks_per_chunk

    # --- commit ------------------------------------------------------------------------------------
    def commit(
        self,
        held: Holding,
        token_ids: list[int],
        num_computed: int,
        prefix_hashes: list[bytes],
        root: bytes,
    ) -> list[Committed]:
        """Register the request's completed chunks (up to its register limit) in the store; returns
        those it inserted. `prefix_hashes` (the request's) is extended with the hashes of chunks of
        generated tokens."""
        held.num_committed_tokens = num_computed
        num_full = num_computed // self.chunk_size
        if held.register_limit is not None:
            num_full = min(num_full, held.register_limit)
        if len(prefix_hashes) < num_full:  # chunks made of generated tokens
            last = prefix_hashes[-1] if prefix_hashes else root
            prefix_hashes += chunk_prefix_hashes(
                token_ids[: num_full * self.chunk_size], self.chunk_size, last, len(prefix_hashes)
            )
        bpc = self.blocks_per_chunk
        full = self.num_full_groups
        inserted: list[Committed] = []
        for i in range(held.num_chunks_in_store, num_full):
            h = prefix_hashes[i]
            chunk = self.store.get(h)
            if chunk is None:
                blocks = [b for t in held.tables[:full] for b in t[i * bpc : (i + 1) * bpc]]
                window = self._window_of(held, i)
                self.pool.retain(blocks + window)
                parent = prefix_hashes[i - 1] if i else None
                keys = self._block_keys(token_ids, i, parent or root)
                chunk = self.store.insert(h, blocks, i, parent, window_blocks=window, block_keys=keys)
                inserted.append(Committed(chunk, i))
            else:
                # computed concurrently by another request: ours stays private, but hold the cached
                # copy so it stays the parent of the chunks this request registers next
                self.store.acquire(chunk, hit=False)
                if self.windowed and not chunk.window_blocks and (window := self._window_of(held, i)):
                    self.pool.retain(window)  # recomputed after its sliding part was dropped
                    self.store.restore_window(chunk, window)
            held.used_chunks.append(h)
            landed(self.in_flight, held, h)
        held.num_chunks_in_store = max(held.num_chunks_in_store, num_full)
        return inserted

    def _block_keys(self, token_ids: list[int], index: int, parent: bytes) -> list[bytes]:
        """The keys of chunk `index`'s first 1 .. blocks_per_chunk - 1 blocks (for `match_blocks`)."""
        start = index * self.chunk_size
        return block_keys(
            parent, token_ids[start : start + self.chunk_size - self.block_size], self.block_size
        )

    def _window_of(self, held: Holding, index: int) -> list[int]:
        """The request's sliding-group blocks of chunk `index`, [] if some already left the window."""
        bpc = self.blocks_per_chunk
        window = [b for t in held.tables[self.num_full_groups :] for b in t[index * bpc : (index + 1) * bpc]]
        return [] if -1 in window else window

    def commit_tail(
        self, held: Holding, tail: list[int], prefix_hashes: list[bytes], root: bytes
    ) -> tuple[bytes, list[int]] | None:
        """Cache a prompt's tail (`tail`: its tokens after its full chunks, fewer than a chunk; a warmed
        document's end), for content matches. Returns its hash and its last block when this call
        cached it and it ends mid-block (to seal), or None when it may not be cached (its chunks
        before it are not all in the store, or its KV is approximate)."""
        full = len(prefix_hashes)
        if not tail or held.num_chunks_in_store < full or held.register_limit is not None:
            return None
        assert self.num_groups == 1, "tails are for content matches, which layer groups do not take"
        parent = prefix_hashes[full - 1] if full else None
        h = tail_hash(parent or root, tail)
        chunk = self.store.get(h)
        open_block: list[int] = []
        if chunk is None:
            first = full * self.blocks_per_chunk
            blocks = held.tables[0][first : first + cdiv(len(tail), self.block_size)]
            self.pool.retain(blocks)
            self.store.insert(h, blocks, full, parent, len(tail))
            open_block = blocks[-1:] if len(tail) % self.block_size else []
        else:
            self.store.acquire(chunk, hit=False)
        held.used_chunks.append(h)
        return h, open_block

    def commit_blocks(
        self,
        held: Holding,
        token_ids: list[int],
        num_computed: int,
        prefix_hashes: list[bytes],
        root: bytes,
    ) -> CachedChunk | None:
        """When its prompt is in, and before it is freed: cache the whole blocks the request computed
        after its last full chunk (its first num_computed tokens' KV is complete), keyed block by
        block, so a prompt that shares them (the next question over the same system prompt, the next
        turn of a chat) reuses them through `match_blocks`: an exact hit ends on a block, as fine as
        the pool's unit, not on a chunk. Returns the entry cached, or None: no whole block, KV not
        exact (a register limit), its chunks not all in the store, sliding-window layers (tails take
        one layer group), or every one of its blocks already findable."""
        num_full = num_computed // self.chunk_size
        if self.num_groups != 1 or held.register_limit is not None or held.num_chunks_in_store < num_full:
            return None
        bs = self.block_size
        num_blocks = (num_computed - num_full * self.chunk_size) // bs
        if num_blocks == 0:  # (its num_full chunks are in the store: `commit` hashed them all)
            return None
        parent = prefix_hashes[num_full - 1] if num_full else None
        start = num_full * self.chunk_size
        tokens = token_ids[start : start + num_blocks * bs]
        keys = block_keys(parent or root, tokens, bs)
        found = self.store.match_blocks(keys)
        if found is not None and found[1] == num_blocks:
            return None  # another chunk already has all of these blocks
        h = blocks_hash(parent or root, tokens)
        if h in self.store:
            return None
        first = num_full * self.blocks_per_chunk
        blocks = held.tables[0][first : first + num_blocks]
        assert len(blocks) == num_blocks and -1 not in blocks
        self.pool.retain(blocks)
        chunk = self.store.insert(h, blocks, num_full, parent, num_blocks * bs, block_keys=keys)
        held.used_chunks.append(h)  # released by `free`, after which it is evictable
        return chunk

    def make_room(self, num_blocks: int, keep: set[bytes] | None = None) -> bool:
        """Free `num_blocks` pool blocks: drop unread sliding-window parts of cached chunks (not those
        of `keep`), then evict unused cached chunks; False if they cannot be freed."""
        if num_blocks > self.pool.num_free_blocks and self.windowed:
            self.store.drop_windows(num_blocks - self.pool.num_free_blocks, keep or set())
        if num_blocks > self.pool.num_free_blocks:
            self.store.evict(num_blocks - self.pool.num_free_blocks)
        return num_blocks <= self.pool.num_free_blocks

    # --- import ------------------------------------------------------------------------------------
    def import_chunk(
        self,
        prefix_hash: bytes,
        depth: int,
        parent: bytes | None,
        write: Callable[[list[list[int]]], None],
    ) -> CachedChunk | None:
        """Cache a chunk loaded from a KV tier: fresh blocks in every layer group (after evicting),
        filled by `write` (given each group's blocks), held
        by the store alone (evictable like any unused chunk). None when its parent is not cached or
        no blocks can be freed. The parent is held meanwhile, so the eviction cannot pick it (a chain
        loaded into a full pool would cut itself off)."""
        held_parent = self.store.get(parent) if parent is not None else None
        if parent is not None and held_parent is None:
            return None
        if held_parent is not None:
            self.store.acquire(held_parent, hit=False)
        try:
            keep = {parent} if parent is not None else set()
            if not self.make_room(self.blocks_per_chunk * self.num_groups, keep):
                return None
            groups = [self.pool.allocate(self.blocks_per_chunk) for _ in range(self.num_groups)]
            write(groups)
            full = self.num_full_groups
            chunk = self.store.insert(  # takes over the allocation's ref
                prefix_hash,
                [b for t in groups[:full] for b in t],
                depth,
                parent,
                window_blocks=[b for t in groups[full:] for b in t],
            )
            self.store.release(prefix_hash)  # no user
            return chunk
        finally:
            if held_parent is not None:
                self.store.release(held_parent.prefix_hash)

    def group_blocks(self, chunk: CachedChunk, group: int) -> list[int]:
        """The chunk's blocks of layer group `group` (global groups come first in the layout)."""
        n = cdiv(chunk.num_tokens, self.block_size)
        full = self.num_full_groups
        if group < full:
            return chunk.block_ids[group * n : (group + 1) * n]
        return chunk.window_blocks[(group - full) * n : (group - full + 1) * n]

    def chunk_group_blocks(self, chunk: CachedChunk) -> list[list[int]] | None:
        """The chunk's blocks per layer group, or None when its sliding parts were dropped."""
        if self.windowed and not chunk.window_blocks:
            return None
        return [self.group_blocks(chunk, g) for g in range(self.num_groups)]
