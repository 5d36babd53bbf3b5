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

and, outside any request: pin / unpin (warmed text; `book_pins` for a warm about to run), `evict_idle`
(the KV tiers' idle demotion) and `on_evict` (the tiers see each evicted chunk).

With sliding-window layers (kvcache/layout.py) a request holds one block table per layer group, all
of one length; a sliding group's entries before its window are -1 (given back by `slide`). Every
count of blocks the scheduler sees (`num_new_blocks`, `grow`'s) is per group; the pool gives
num_groups times as many.

With CacheEntries (entries.py: what enters the chunk store, called with a request's Holding), it is
the only caller of the pool's `allocate` and `retain` (tests/unit/test_kv_ownership.py checks that),
and nothing outside kvcache/ calls a mutating method of the pool or the chunk store; the chunk store
releases the blocks of the chunks it drops. Per-request state (`Holding`) is keyed by request id.

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

from kvserve.config_slices import CacheConfig
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.entries import CacheEntries
from kvserve.kvcache.hashing import block_keys
from kvserve.kvcache.holding import Committed, Holding, Reservation, cdiv, check_holdings, landed
from kvserve.kvcache.layout import KVLayout
from kvserve.kvcache.stats import PoolStats, StoreStats, cache_stats


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
        self.entries = CacheEntries(pool, store, self.layout, self.in_flight)

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
        """Free `num_blocks` pool blocks (CacheEntries.make_room); False if they cannot be freed."""
        return self.entries.make_room(num_blocks, keep)

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
                b for c in matched for b in self.entries.group_blocks(c, g) or [-1] * self.blocks_per_chunk
            ]
            if partial is not None:
                table += self.entries.group_blocks(partial[0], g)[: partial[1]]
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

    def chunk_group_blocks(self, chunk: CachedChunk) -> list[list[int]] | None:
        """The chunk's blocks per layer group, or None when its sliding parts were dropped."""
        return self.entries.chunk_group_blocks(chunk)

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

    # --- commit (kvcache/entries.py) ---------------------------------------------------------------
    def commit(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        prefix_hashes: list[bytes],
        root: bytes,
    ) -> list[Committed]:
        """Register the request's completed chunks (up to its register limit) in the store; returns
        those it inserted. `prefix_hashes` (the request's) is extended with generated chunks' hashes."""
        return self.entries.commit(
            self._holding(request_id, "commit"), token_ids, num_computed, prefix_hashes, root
        )

    def commit_tail(
        self, request_id: str, tail: list[int], prefix_hashes: list[bytes], root: bytes
    ) -> tuple[bytes, list[int]] | None:
        """Cache a prompt's tail for content matches (CacheEntries.commit_tail)."""
        return self.entries.commit_tail(self._holding(request_id, "commit_tail"), tail, prefix_hashes, root)

    def commit_blocks(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        prefix_hashes: list[bytes],
        root: bytes,
    ) -> CachedChunk | None:
        """Cache the whole blocks computed after the last full chunk (CacheEntries.commit_blocks)."""
        held = self._holding(request_id, "commit_blocks")
        return self.entries.commit_blocks(held, token_ids, num_computed, prefix_hashes, root)

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
            landed(self.in_flight, held, h)

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
            landed(self.in_flight, held, h)

    def reset(self) -> None:
        """Start over: no holding, nothing in flight, no cached chunk or pin, every block free. For the
        engine's rebuild after a failed step left books that disagree, so nothing is released one by
        one (ChunkStore.reset, BlockPool.reset)."""
        self._held.clear()
        self.in_flight.clear()
        self.store.reset()
        self.pool.reset()

    def import_chunk(
        self, prefix_hash: bytes, depth: int, parent: bytes | None, write: Callable[[list[list[int]]], None]
    ) -> CachedChunk | None:
        """Cache a chunk loaded from a KV tier (CacheEntries.import_chunk)."""
        return self.entries.import_chunk(prefix_hash, depth, parent, write)

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
        check_holdings(self.pool, self.store, self._held, self.in_flight, admitted)
