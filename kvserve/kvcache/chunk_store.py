"""ChunkStore: prefix hash -> cached chunk (its blocks in the pool). Content matches are found
through piece_index.PieceIndex, which points into these chunks.

Ownership: the store holds one pool ref on each block of each cached chunk (given by the
KVCacheManager, which inserts; released here when the chunk is dropped). A chunk's `num_users`
counts the running requests that use it (matched it, computed and registered it, or hold it as the
parent of a chunk they will register). Cached chunks form a tree by prefix (a chunk's parent is the
chunk before it in its prompt; depth-0 chunks hang off the root), and the tree stays whole: a chunk
is inserted only under a cached parent, and only leaves are evictable, so eviction never leaves a
chunk whose parent is gone (an orphan no lookup could reach, still holding memory).

Pins are counted per owner (a warmed text): a chunk stays pinned while any owner pins it, so
unpinning "system + doc A" keeps the system chunks that "system + doc B" still pins. Pinned blocks are
capped at `max_pinned_blocks`; `reserve_pins` books room for a warm before it runs.

A full chunk computed here also keeps the keys of its leading whole blocks (`block_keys`,
hashing.block_keys): a prompt that shares only the first blocks of a cached chunk (a new question after
a cached document that ends mid-chunk) finds them with `match_blocks` and reuses those blocks, so an
exact prefix hit is as fine as a block, not a chunk. A request whose prompt is in, or that is done,
also caches the whole blocks it computed past its last full chunk as a block tail (fewer than a
chunk's tokens, every one of its blocks keyed: KVCacheManager.commit_blocks), so the next question
over the same system prompt, or the next turn of a chat, hits to the block too. The keys go with the
chunk when it is dropped.

Evictable == no users, no pin, no cached children; only evictable chunks are known to the eviction
policy.

With sliding-window layers (kvcache/layout.py) a chunk holds its global groups' blocks (`block_ids`)
and its sliding groups' (`window_blocks`). The sliding part is needed only by a prefix hit that
ends less than a window after the chunk, so it is dropped on its own, before any whole chunk is
evicted (`drop_windows`: oldest first, once no request reads those blocks and the chunk is not
pinned); the chunk stays a link of its prefix, and `KVCacheManager.match` ends a hit where the
sliding parts before it are missing.

Before a chunk is evicted (for room, or idle: `evict_idle`) the `on_evict` hooks see it with its
blocks still intact: the KV tiers demote or write it there (tiers/manager.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvserve.kvcache.block_index import BlockIndex
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.eviction import POLICIES, EvictionPolicy
from kvserve.kvcache.layout import KVLayout


class ChunkStore:
    def __init__(
        self,
        pool: BlockPool,
        chunk_size: int,
        policy: str = "lru_freq",
        max_pinned_blocks: int | None = None,
        layout: KVLayout | None = None,
    ):
        assert chunk_size % pool.block_size == 0
        self.pool = pool
        self.layout = layout if layout is not None else KVLayout.single()
        self.num_groups = self.layout.num_groups  # blocks per block of tokens
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // pool.block_size
        self.policy: EvictionPolicy = POLICIES[policy]()
        self.max_pinned_blocks = pool.num_blocks if max_pinned_blocks is None else max_pinned_blocks
        self._chunks: dict[bytes, CachedChunk] = {}
        self._pins: dict[bytes, list[bytes]] = {}  # owner -> the chunks it pins
        self.block_index = BlockIndex()  # block key -> (chunk, its leading blocks): match_blocks
        self.on_drop: list[Callable[[bytes], None]] = []  # called with each evicted chunk's hash
        self.on_evict: list[Callable[[CachedChunk], None]] = []  # before eviction, blocks intact
        self.num_evicted_chunks = 0
        self.num_windows_dropped = 0  # sliding-window parts dropped (drop_windows)
        self.num_chunk_hits = 0  # acquisitions of cached chunks by requests that reuse them
        # block -> the cached chunks holding it (more than one: a chunk whose leading blocks it shares)
        self._holders: Counter[int] = Counter()
        self._pinned_holders: Counter[int] = Counter()  # block -> the pinned chunks holding it
        self.num_reserved_pin_blocks = 0  # booked by warms still running

    # --- lookup ----------------------------------------------------------------------------------
    def __contains__(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, prefix_hash: bytes) -> CachedChunk | None:
        return self._chunks.get(prefix_hash)

    def match_blocks(self, keys: list[bytes]) -> tuple[CachedChunk, int] | None:
        """The cached chunk whose leading blocks have the longest of `keys` (hashing.block_keys of a
        prompt's next chunk, shortest first), and how many blocks that is; None if none has even one."""
        found = self.block_index.match(keys)
        return (self._chunks[found[0]], found[1]) if found is not None else None

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
        """A request starts using `chunk` (the caller retains its blocks if it reads them)."""
        if chunk.evictable:
            self.policy.remove(chunk.prefix_hash)
        chunk.num_users += 1
        chunk.last_used = time.monotonic()
        if hit:
            chunk.num_hits += 1
            self.num_chunk_hits += 1
            self.policy.touch(chunk.prefix_hash)

    def release(self, prefix_hash: bytes) -> None:
        chunk = self._chunks.get(prefix_hash)
        if chunk is None:
            return
        assert chunk.num_users > 0
        chunk.num_users -= 1
        chunk.last_used = time.monotonic()
        self._maybe_evictable(chunk)

    def insert(
        self,
        prefix_hash: bytes,
        block_ids: list[int],
        depth: int,
        parent: bytes | None,
        num_tokens: int = 0,
        window_blocks: list[int] | None = None,
        block_keys: list[bytes] | None = None,
    ) -> CachedChunk:
        """Register a chunk computed by a running request, which becomes its first user. The parent
        must be cached (the caller holds it). The caller (kvcache/manager.py) has given the store one
        pool ref on each block (`block_ids` and `window_blocks`); the store releases it when it drops
        the chunk. A tail (num_tokens < chunk_size) is never prefix-matched by hash: a prompt's tail is
        held for content matches, a block tail (with block_keys) for match_blocks."""
        num_tokens = num_tokens or self.chunk_size
        assert prefix_hash not in self._chunks and 0 < num_tokens <= self.chunk_size
        window_blocks = list(window_blocks or [])
        self._check_blocks(num_tokens, block_ids, window_blocks)
        if parent is not None:
            parent_chunk = self._chunks[parent]  # KeyError: inserting under an evicted parent
            if parent_chunk.evictable:
                self.policy.remove(parent)
            parent_chunk.num_children += 1
        chunk = CachedChunk(
            prefix_hash,
            list(block_ids),
            depth,
            parent,
            num_tokens,
            num_users=1,
            last_used=time.monotonic(),
            window_blocks=window_blocks,
        )
        if parent is not None and not self._chunks[parent].exact:
            chunk.exact = False  # computed attending to approximate KV
        self._chunks[prefix_hash] = chunk
        self._holders.update(chunk.all_block_ids)
        self.block_index.add(chunk, block_keys or [], self._chunks, self.chunk_size)
        self.policy.touch(prefix_hash)
        return chunk

    # --- pins ------------------------------------------------------------------------------------
    def pin(self, owner: bytes, prefix_hashes: list[bytes]) -> int:
        """`owner` pins the cached chunks among `prefix_hashes` (again pinning is a no-op for chunks it
        already pins); returns how many chunks it pins now."""
        held = self._pins.setdefault(owner, [])
        for h in prefix_hashes:
            chunk = self._chunks.get(h)
            if chunk is None or h in held:
                continue
            if chunk.evictable:
                self.policy.remove(h)
            if chunk.num_pins == 0:
                self._pinned_holders.update(chunk.all_block_ids)
            chunk.num_pins += 1
            held.append(h)
        if not held:
            del self._pins[owner]
        return len(held)

    def unpin(self, owner: bytes) -> int:
        """Release every pin of `owner`; returns how many chunks it pinned (0 if none)."""
        held = self._pins.pop(owner, [])
        for h in held:
            chunk = self._chunks[h]  # pinned chunks are never evicted
            chunk.num_pins -= 1
            if chunk.num_pins == 0:
                self._forget_blocks(chunk.all_block_ids, self._pinned_holders)
            self._maybe_evictable(chunk)
        return len(held)

    def unpinned_blocks(self, prefix_hashes: list[bytes], num_blocks_each: list[int]) -> int:
        """Blocks that pinning these chunks would add: those not cached yet (counted at
        `num_blocks_each`) or cached and not pinned."""
        total = 0
        for h, n in zip(prefix_hashes, num_blocks_each, strict=True):
            chunk = self._chunks.get(h)
            if chunk is None or not chunk.pinned:
                total += n
        return total

    def reserve_pins(self, num_blocks: int) -> bool:
        """Book room for `num_blocks` more pinned blocks (a warm about to run); False over the cap."""
        if self.num_pinned_blocks + self.num_reserved_pin_blocks + num_blocks > self.max_pinned_blocks:
            return False
        self.num_reserved_pin_blocks += num_blocks
        return True

    def release_pin_reservation(self, num_blocks: int) -> None:
        self.num_reserved_pin_blocks -= num_blocks
        assert self.num_reserved_pin_blocks >= 0

    def _maybe_evictable(self, chunk: CachedChunk) -> None:
        if chunk.evictable:
            self.policy.add(chunk.prefix_hash)

    # --- eviction --------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Evict chunks, leaves first, until `num_blocks` blocks were freed or nothing is evictable;
        returns blocks freed. A parent left childless becomes a candidate in its turn."""
        freed = 0
        while freed < num_blocks:
            victim = self.policy.pop_victim()
            if victim is None:
                break
            freed += self._evict(victim)
        return freed

    def drop_windows(self, num_blocks: int, keep: set[bytes]) -> int:
        """Drop the sliding-window parts of cached chunks, oldest first, until `num_blocks` blocks were
        freed or none is left to drop; returns blocks freed. A part is dropped only when the store
        alone holds its blocks (no request reads them), its chunk is not pinned and not in `keep`
        (chunks an admission is about to read)."""
        if not num_blocks:
            return 0
        refs = self.pool.ref_counts
        candidates = [
            c
            for c in self._chunks.values()
            if c.window_blocks
            and not c.pinned
            and c.prefix_hash not in keep
            and all(refs[b] == 1 for b in c.window_blocks)
        ]
        freed = 0
        for chunk in sorted(candidates, key=lambda c: (c.last_used, c.depth)):
            if freed >= num_blocks:
                break
            freed += len(chunk.window_blocks)
            self._drop_window(chunk)
        return freed

    def restore_window(self, chunk: CachedChunk, window_blocks: list[int]) -> None:
        """Give a chunk whose sliding-window part was dropped that part again (a request recomputed
        it; the caller gave the store one pool ref on each block)."""
        assert not chunk.window_blocks
        self._check_blocks(chunk.num_tokens, chunk.block_ids, window_blocks)
        chunk.window_blocks = list(window_blocks)
        self._holders.update(window_blocks)
        if chunk.pinned:
            self._pinned_holders.update(window_blocks)

    def _drop_window(self, chunk: CachedChunk) -> None:
        blocks, chunk.window_blocks = chunk.window_blocks, []
        self._forget_blocks(blocks)
        self.num_windows_dropped += 1
        self.pool.release(blocks)

    def evict_idle(self, unused_since: float) -> int:
        """Evict every evictable chunk not used since `unused_since` (time.monotonic()), leaves first:
        a parent whose children all go goes too if it is idle. Returns chunks evicted."""
        num = 0
        while True:
            idle = [h for h in self.policy.candidates() if self._chunks[h].last_used < unused_since]
            if not idle:
                return num
            for h in idle:  # leaves (evictable chunks have no children): any order
                self.policy.remove(h)
                self._evict(h)
                num += 1

    def _evict(self, prefix_hash: bytes) -> int:
        for hook in self.on_evict:
            hook(self._chunks[prefix_hash])
        self.num_evicted_chunks += 1
        return self._drop(prefix_hash)

    def _drop(self, prefix_hash: bytes) -> int:
        chunk = self._chunks.pop(prefix_hash)
        assert chunk.evictable
        self.policy.forget(prefix_hash)
        if chunk.parent is not None:
            parent = self._chunks[chunk.parent]
            parent.num_children -= 1
            self._maybe_evictable(parent)
        self.block_index.drop(chunk)
        blocks = chunk.all_block_ids
        self.pool.release(blocks)
        self._forget_blocks(blocks)
        for hook in self.on_drop:
            hook(prefix_hash)
        return sum(1 for b in blocks if self.pool.ref_counts[b] == 0)

    def _forget_blocks(self, blocks: list[int], holders: Counter[int] | None = None) -> None:
        holders = self._holders if holders is None else holders
        holders.subtract(blocks)
        for b in blocks:
            if holders[b] <= 0:
                del holders[b]

    def reset(self) -> None:
        """Drop every chunk, pinned or not, every pin and every pin booking, releasing no block (the
        engine's rebuild after a failed step: BlockPool.reset frees them all). The `on_drop` hooks hear
        of each chunk (the content index forgets its pieces); the `on_evict` hooks do not: nothing of a
        pool whose books failed goes to a KV tier. The counters stay."""
        dropped = list(self._chunks)
        self._chunks.clear()
        self._pins.clear()
        self.block_index.clear()
        self._holders.clear()
        self._pinned_holders.clear()
        self.num_reserved_pin_blocks = 0
        self.policy = type(self.policy)()
        for prefix_hash in dropped:
            for hook in self.on_drop:
                hook(prefix_hash)

    # --- facts -----------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Distinct blocks cached chunks hold (a block two chunks share counts once)."""
        return len(self._holders)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks pinned chunks hold."""
        return len(self._pinned_holders)

    @property
    def num_pinned_chunks(self) -> int:
        return sum(1 for c in self._chunks.values() if c.pinned)

    @property
    def num_pin_owners(self) -> int:
        return len(self._pins)

    def pin_owners(self) -> list[bytes]:
        return list(self._pins)

    def chunks(self) -> list[CachedChunk]:
        return list(self._chunks.values())

    def _check_blocks(self, num_tokens: int, block_ids: list[int], window_blocks: list[int]) -> None:
        """A chunk holds each global group's blocks for its tokens, and each sliding group's or none."""
        per_group = -(-num_tokens // self.pool.block_size)
        full = self.layout.num_full_groups
        sliding = self.num_groups - full
        assert len(block_ids) == full * per_group, f"{len(block_ids)} global blocks for {num_tokens} tokens"
        assert len(window_blocks) in (0, sliding * per_group), f"{len(window_blocks)} sliding blocks"

    def check_integrity(self) -> None:
        assert self._holders == Counter(b for c in self._chunks.values() for b in c.all_block_ids)
        children = dict.fromkeys(self._chunks, 0)
        pins = dict.fromkeys(self._chunks, 0)
        for owner, held in self._pins.items():
            assert held and len(set(held)) == len(held), f"owner {owner.hex()[:8]} pins a chunk twice"
            for h in held:
                pins[h] += 1
        for h, chunk in self._chunks.items():
            assert chunk.prefix_hash == h
            self._check_blocks(chunk.num_tokens, chunk.block_ids, chunk.window_blocks)
            for b in chunk.all_block_ids:
                assert self.pool.ref_counts[b] >= 1, f"cached chunk holds free block {b}"
            if chunk.parent is not None:
                assert chunk.parent in self._chunks, f"chunk {h.hex()[:8]} is cached but its parent is not"
                children[chunk.parent] += 1
        for h, chunk in self._chunks.items():
            assert chunk.num_children == children[h], "child count mismatch"
            assert chunk.num_pins == pins[h], "pin count does not match the owners' pins"
        pinned = Counter(b for c in self._chunks.values() if c.pinned for b in c.all_block_ids)
        assert self._pinned_holders == pinned, "pinned blocks do not match the pinned chunks"
        assert self.num_pinned_blocks <= self.max_pinned_blocks
        assert self.policy.candidates() == {h for h, c in self._chunks.items() if c.evictable}
        self.block_index.check_integrity(self._chunks, self.blocks_per_chunk, self.pool.block_size)
