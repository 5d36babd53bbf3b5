"""KVCacheManager: the one owner of the paged pool's blocks and of every request's hold on them.

The scheduler decides policy (which request, how many rows, whom to preempt); the manager keeps the
books. Its verbs, in a request's order:

  match    the cached chunks of the longest cached run of leading prefix hashes (no side effects)
  reserve  hold the chunks an admission uses and make room for its new blocks (evicting unused
           cached chunks), or undo and say no; `can_ever_fit` tells "wait" from "never"
  admit    open the request's holding: the matched chunks' blocks (shared) and its new blocks
  grow     blocks for n more tokens, evicting if it must (False: the pool cannot give them now)
  commit   register its completed chunks (and a warm's tail) in the chunk store
  slide    after a step, give back the sliding-window groups' blocks no later row can read
  free     give back everything it holds (finished or preempted)
  import   a chunk loaded from a KV tier, written into fresh blocks and cached without a user

and, outside any request: pin / unpin (warmed text, with `book_pins` for a warm about to run),
`evict_idle` (the KV tiers' idle demotion) and `on_evict` (the tiers see each evicted chunk).

With sliding-window layers (kvcache/layout.py) a request holds one block table per layer group, all
of one length; a sliding group's entries before its window are -1 (given back by `slide`). Every
count of blocks the scheduler sees (`num_new_blocks`, `grow`'s) is per group; the pool gives
num_groups times as many.

It is the only caller of the pool's `allocate` and `retain` (tests/unit/test_kv_ownership.py checks
that), and nothing outside kvcache/ calls a mutating method of the pool or the chunk store; the
chunk store releases the blocks of the chunks it drops. Per-request state (`Holding`) is
keyed by request id, so a `Sequence` holds only what the request is and where it stands.

The order is enforced, not described: `admit` takes the Reservation `reserve` returned, once; a
request's verbs (grow, commit, slide, ...) raise for a request that is not admitted, or no longer
(after `free`); `slide` raises before the `commit` of the same tokens when the request registers
chunks. The checks are assertions: on in tests and normal runs, off under `python -O`.

Ownership (invariant 3): a block's pool ref count == the holdings that hold it + 1 if a cached chunk
holds it; a cached chunk's user count == the holdings that use it; `check_integrity` verifies both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config_slices import CacheConfig
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.kvcache.hashing import block_keys, blocks_hash, chunk_prefix_hashes, tail_hash
from kvserve.kvcache.layout import KVLayout
from kvserve.kvcache.stats import PoolStats, StoreStats, cache_stats


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


class KVCacheManager:
    @classmethod
    def create(
        cls,
        config: CacheConfig,
        num_blocks: int,
        on_free: list[Callable[[int], None]],
        layout: KVLayout | None = None,
    ) -> KVCacheManager:
        """The pool of `num_blocks` blocks and its chunk store, as the config sizes them; `on_free` is
        called with each block that returns to the free list (the layers' storages)."""
        pool = BlockPool(num_blocks, config.block_size)
        pool.on_free.extend(on_free)
        max_pinned = int(config.max_pinned_fraction * num_blocks)
        store = ChunkStore(pool, config.chunk_size, config.eviction_policy, max_pinned, layout)
        return cls(pool, store, layout, registers=config.enable_prefix_caching)

    def __init__(
        self, pool: BlockPool, store: ChunkStore, layout: KVLayout | None = None, registers: bool = True
    ):
        self.pool, self.store = pool, store
        self.registers = registers  # requests commit what they compute (prefix caching on)
        self.layout = layout if layout is not None else KVLayout.single()
        self.num_groups = self.layout.num_groups
        self.num_full_groups = self.layout.num_full_groups
        self.windowed = self.layout.windowed
        self.block_size = pool.block_size
        self.chunk_size = store.chunk_size
        self.blocks_per_chunk = store.blocks_per_chunk
        self.in_flight: Counter[bytes] = Counter()  # prompt chunks being computed right now
        self._held: dict[str, Holding] = {}

    # --- reading -----------------------------------------------------------------------------------
    def holding(self, request_id: str) -> Holding | None:
        return self._held.get(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in position order ([] when it holds none): its first layer group's
        (a model without sliding-window layers has only that one)."""
        held = self._held.get(request_id)
        return held.tables[0] if held is not None else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each layer group (-1: a block that left a sliding window)."""
        held = self._held.get(request_id)
        return [list(t) for t in held.tables] if held is not None else [[] for _ in range(self.num_groups)]

    def _first_needed(self, group: int, num_tokens: int) -> int:
        return self.layout.first_needed_block(group, num_tokens, self.block_size)

    def max_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most pool blocks a request of `num_tokens` tokens holds at once (`step_tokens` rows a step)."""
        return self.layout.max_blocks(num_tokens, self.block_size, step_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # --- match -------------------------------------------------------------------------------------
    def match(self, prefix_hashes: list[bytes]) -> list[CachedChunk]:
        """The longest cached run of leading chunks whose KV a request can continue from: with
        sliding-window layers, the run ends where the chunks within a window before its end still
        hold their sliding parts (a row after a hit of n tokens reads tokens from n - window + 1)."""
        matched = self.store.match_prefix(prefix_hashes)
        if not self.windowed:
            return matched
        n = len(matched)
        while n and not all(c.window_blocks for c in matched[self._first_needed_chunk(n) : n]):
            n -= 1
        return matched[:n]

    def match_blocks(
        self, prefix_hashes: list[bytes], token_ids: list[int], num_chunks: int, root: bytes, max_tokens: int
    ) -> tuple[CachedChunk, int] | None:
        """After a hit of `num_chunks` chunks, the cached chunk that shares the most leading whole
        blocks with the prompt's next chunk, and how many (at most `max_tokens` tokens in all); None
        when none shares a block. With sliding-window layers the chunk must still hold its sliding
        part (the chunks before it that the window reaches do: `match` checked them for a shorter end)."""
        if self.blocks_per_chunk == 1:
            return None
        start = num_chunks * self.chunk_size
        bs = self.block_size
        num_blocks = min(self.blocks_per_chunk - 1, (max_tokens - start) // bs)
        if num_blocks <= 0:
            return None
        parent = prefix_hashes[num_chunks - 1] if num_chunks else root
        found = self.store.match_blocks(block_keys(parent, token_ids[start : start + num_blocks * bs], bs))
        if found is not None and self.windowed and not found[0].window_blocks:
            return None
        return found

    def _first_needed_chunk(self, num_chunks: int) -> int:
        """The first chunk whose sliding part a row after `num_chunks` chunks reads (the widest window's)."""
        first = min(self._first_needed(g, num_chunks * self.chunk_size) for g in self.layout.sliding_groups)
        return first // self.blocks_per_chunk

    def num_blocks_available_to(self, matched: list[CachedChunk]) -> int:
        """Blocks a request sharing `matched` could ever hold: all but other pinned chunks' blocks."""
        shared_pinned = sum(len(c.all_block_ids) for c in matched if c.pinned)
        return self.pool.num_blocks - self.store.num_pinned_blocks + shared_pinned

    # --- reserve -----------------------------------------------------------------------------------
    def reserve(self, chunks: list[CachedChunk], num_new_blocks: int) -> Reservation | None:
        """Hold `chunks` (so eviction spares them) and make room for `num_new_blocks`: the Reservation
        `admit` takes; on failure undo and return None."""
        for chunk in chunks:
            self.store.acquire(chunk)
        if self.make_room(num_new_blocks * self.num_groups, keep={c.prefix_hash for c in chunks}):
            return Reservation([c.prefix_hash for c in chunks], num_new_blocks)
        for chunk in chunks:
            self.store.release(chunk.prefix_hash)
        return None

    def make_room(self, num_blocks: int, keep: set[bytes] | None = None) -> bool:
        """Free `num_blocks` pool blocks: drop unread sliding-window parts of cached chunks (not those
        of `keep`), then evict unused cached chunks; False if they cannot be freed."""
        if num_blocks > self.pool.num_free_blocks and self.windowed:
            self.store.drop_windows(num_blocks - self.pool.num_free_blocks, keep or set())
        if num_blocks > self.pool.num_free_blocks:
            self.store.evict(num_blocks - self.pool.num_free_blocks)
        return num_blocks <= self.pool.num_free_blocks

    def can_ever_fit(
        self,
        matched: list[CachedChunk],
        sources: list[CachedChunk],
        num_new_blocks: int,
        num_partial_blocks: int = 0,
    ) -> bool:
        """Whether the blocks an admission holds (shared prefix, a cached chunk's leading blocks, new
        blocks, and the content-hit sources it holds while their KV is copied) fit beside the chunks
        other owners pinned."""
        shared = {c.prefix_hash for c in matched}
        held = [c for c in sources if c.prefix_hash not in shared and not c.pinned]
        blocks = (
            sum(len(c.all_block_ids) for c in matched)
            + (num_new_blocks + num_partial_blocks) * self.num_groups
        )
        blocks += sum(len(c.all_block_ids) for c in held)
        return blocks <= self.num_blocks_available_to(matched)

    def never_fits_reason(self) -> str:
        """Why a request alone in the pool still lacks blocks: pinned chunks hold the rest."""
        return (
            f"the request needs more KV blocks than can ever be free: {self.store.num_pinned_blocks} of "
            f"the pool's {self.pool.num_blocks} blocks are pinned; unpin warmed text (DELETE /v1/warm) "
            "or lower max_tokens"
        )

    # --- admit and grow ----------------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        reservation: Reservation,
        matched: list[CachedChunk],
        sources: list[CachedChunk],
        partial: tuple[CachedChunk, int] | None = None,
    ) -> Holding:
        """Open the request's holding with what `reserve` held for matched + sources (+ the partial
        hit's chunk): it shares the matched chunks' blocks (a sliding group only those its next row can
        read) and the first blocks of `partial` (`match_blocks`), and gets the reservation's new blocks
        in each layer group."""
        assert request_id not in self._held, f"{request_id} is admitted twice"
        assert not reservation.admitted, f"admit {request_id}: its reservation was admitted already"
        held_chunks = [c.prefix_hash for c in matched + sources + ([partial[0]] if partial else [])]
        assert reservation.chunks == held_chunks, f"admit {request_id}: not the chunks `reserve` held"
        reservation.admitted = True
        num_new_blocks = reservation.num_new_blocks
        num_cached = len(matched) * self.chunk_size + (partial[1] * self.block_size if partial else 0)
        tables = []
        for g in range(self.num_groups):
            # a chunk whose sliding part was dropped lies before the window (`match` ends hits there)
            table = [
                b for c in matched for b in self._chunk_group_blocks(c, g) or [-1] * self.blocks_per_chunk
            ]
            if partial is not None:
                table += self._chunk_group_blocks(partial[0], g)[: partial[1]]
            first = min(self._first_needed(g, num_cached), len(table))
            table[:first] = [-1] * first
            assert -1 not in table[first:], "a hit's window reaches a dropped sliding part"
            self.pool.retain(table[first:])
            tables.append(table + self.pool.allocate(num_new_blocks))
        held = self._held[request_id] = Holding(
            tables=tables,
            used_chunks=[c.prefix_hash for c in matched + sources]
            + ([partial[0].prefix_hash] if partial else []),
            num_chunks_in_store=len(matched),
        )
        return held

    def _chunk_group_blocks(self, chunk: CachedChunk, group: int) -> list[int]:
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
        return [self._chunk_group_blocks(chunk, g) for g in range(self.num_groups)]

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Give the request blocks for `num_tokens` tokens, evicting unused cached chunks if it must;
        False (nothing changed but evictions) when the pool cannot give them now."""
        held = self._holding(request_id, "grow")
        need = cdiv(num_tokens, self.block_size) - len(held.tables[0])
        if need <= 0:
            return True
        if not self.make_room(need * self.num_groups):
            return False
        for table in held.tables:
            table.extend(self.pool.allocate(need))
        return True

    def slide(self, request_id: str, num_computed: int) -> None:
        """The request computed `num_computed` tokens: its sliding groups give back the blocks before
        the window of its next row (position `num_computed`). After the `commit` of those tokens, which
        had the store take its own ref on what it caches."""
        held = self._holding(request_id, "slide")
        assert not self.registers or num_computed <= held.num_committed_tokens, (
            f"slide {request_id} to {num_computed} tokens before their commit"
        )
        if not self.windowed:
            return
        for g, table in enumerate(held.tables):
            first = min(self._first_needed(g, num_computed), len(table))
            gone = [b for b in table[:first] if b >= 0]
            if gone:
                table[:first] = [-1] * first
                self.pool.release(gone)

    # --- commit ------------------------------------------------------------------------------------
    def commit(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        prefix_hashes: list[bytes],
        root: bytes,
    ) -> list[Committed]:
        """Register the request's completed chunks (up to its register limit) in the store; returns
        those it inserted. `prefix_hashes` (the request's) is extended with the hashes of chunks of
        generated tokens."""
        held = self._holding(request_id, "commit")
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
            self._landed(held, h)
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
        self, request_id: str, tail: list[int], prefix_hashes: list[bytes], root: bytes
    ) -> tuple[bytes, list[int]] | None:
        """Cache a prompt's tail (`tail`: its tokens after its full chunks, fewer than a chunk; a warmed
        document's end), for content matches. Returns its hash and its last block when this call
        cached it and it ends mid-block (to seal), or None when it may not be cached (its chunks
        before it are not all in the store, or its KV is approximate)."""
        held = self._holding(request_id, "commit_tail")
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
        request_id: str,
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
        held = self._holding(request_id, "commit_blocks")
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

    def mark_in_flight(self, request_id: str, hashes: list[bytes]) -> None:
        """The request will compute and register these chunks: twins wait for them."""
        held = self._holding(request_id, "mark_in_flight")
        held.in_flight = list(hashes)
        self.in_flight.update(hashes)

    def limit(self, request_id: str, prefix_hashes: list[bytes], num_chunks: int) -> None:
        """From chunk `num_chunks` on, the request's KV must not be cached (it is not what its root
        hash names: approximate, or computed at another weight precision): lower its register limit
        and stop holding what it no longer registers in flight (twins compute those instead)."""
        held = self._holding(request_id, "limit")
        if held.register_limit is not None:
            num_chunks = min(num_chunks, held.register_limit)
        held.register_limit = num_chunks
        kept = set(prefix_hashes[:num_chunks])
        for h in [h for h in held.in_flight if h not in kept]:
            self._landed(held, h)

    def release_chunks(self, request_id: str, hashes: set[bytes]) -> None:
        """Stop using these cached chunks (a repair's sources, once their KV is copied)."""
        held = self._holding(request_id, "release_chunks")
        for h in hashes:
            held.used_chunks.remove(h)
            self.store.release(h)

    def _holding(self, request_id: str, verb: str) -> Holding:
        held = self._held.get(request_id)
        assert held is not None, f"{verb} {request_id}: it is not admitted (admit first; nothing after free)"
        return held

    def _landed(self, held: Holding, h: bytes) -> None:
        if h in held.in_flight:
            held.in_flight.remove(h)
            self.in_flight[h] -= 1
            if self.in_flight[h] <= 0:
                del self.in_flight[h]

    # --- free --------------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Give back the request's blocks and chunks, and what it still had in flight."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        for h in held.used_chunks:
            self.store.release(h)
        self.pool.release(b for t in held.tables for b in t if b >= 0)
        for h in list(held.in_flight):
            self._landed(held, h)

    def reset(self) -> None:
        """Start over: no holding, nothing in flight, no cached chunk or pin, every block free. For the
        engine's rebuild after a failed step left books that disagree, so nothing is released one by
        one (ChunkStore.reset, BlockPool.reset)."""
        self._held.clear()
        self.in_flight.clear()
        self.store.reset()
        self.pool.reset()

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

    # --- pins and eviction (what warms and the KV tiers change) ----------------------------------
    def pin(self, owner: bytes, prefix_hashes: list[bytes]) -> int:
        """`owner` pins the cached chunks among `prefix_hashes` (ChunkStore.pin): how many it pins now."""
        return self.store.pin(owner, prefix_hashes)

    def unpin(self, owner: bytes) -> int:
        """Release every pin of `owner`; how many chunks it pinned (0: none)."""
        return self.store.unpin(owner)

    def book_pins(self, num_blocks: int) -> bool:
        """Book room for `num_blocks` more pinned blocks (a pinning warm about to run); False past
        --max-pinned-fraction (nothing booked then)."""
        return self.store.reserve_pins(num_blocks)

    def unbook_pins(self, num_blocks: int) -> None:
        """Give back a booking of `book_pins`."""
        self.store.release_pin_reservation(num_blocks)

    def on_evict(self, hook: Callable[[CachedChunk], None]) -> None:
        """Call `hook` with each cached chunk as it is evicted, its blocks still intact (the KV tiers
        demote or write it)."""
        self.store.on_evict.append(hook)

    def evict_idle(self, unused_since: float) -> int:
        """Evict the unused, unpinned chunks not used since `unused_since` (time.monotonic()), leaves
        first; how many went."""
        return self.store.evict_idle(unused_since)

    # --- facts -------------------------------------------------------------------------------------
    def stats(self, bytes_per_block: float, max_cache_bytes: int) -> tuple[PoolStats, StoreStats]:
        """The pool's blocks by state and the store's counters (one pass over the cached chunks)."""
        return cache_stats(self.pool, self.store, bytes_per_block, max_cache_bytes)

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self, admitted: list[str]) -> None:
        """`admitted`: the request ids that should hold something (the running sequences)."""
        self.pool.check_integrity()
        self.store.check_integrity()
        assert set(self._held) <= set(admitted), "a request that is not running holds cache"
        expected = [0] * self.pool.num_blocks
        for held in self._held.values():
            assert len({len(t) for t in held.tables}) == 1, "layer groups' tables of different lengths"
            for b in (b for t in held.tables for b in t if b >= 0):
                expected[b] += 1
        for chunk in self.store.chunks():
            for b in chunk.all_block_ids:
                expected[b] += 1
        assert expected == self.pool.ref_counts, "pool ref counts do not match owners"
        users = Counter(h for held in self._held.values() for h in held.used_chunks)
        for chunk in self.store.chunks():
            assert chunk.num_users == users.get(chunk.prefix_hash, 0), "chunk user count mismatch"
        flying = Counter(h for held in self._held.values() for h in held.in_flight)
        assert flying == self.in_flight, "in-flight chunks do not match the holdings"
