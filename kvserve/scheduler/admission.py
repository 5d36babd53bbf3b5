"""Admission of a waiting sequence: match -> reserve -> start. What the cache already holds for it
and what it needs (`match`, no side effects), holding that and finding its blocks (`reserve`, or
`can_ever_fit` to tell "wait" from "never"), then opening its holding and the cache's books on it
(`start`). The scheduler decides the order and the budget (Scheduler._admit); the blocks and chunks
are the KVCacheManager's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.manager import KVCacheManager, Reservation, cdiv
from kvserve.reuse import Choice, ContentHit, ContentReuse, Repair
from kvserve.scheduler.sequence import ReuseReport, Sequence


def slice_len(start: int, end: int, budget: int, granularity: int) -> int:
    """Tokens of [start, end) to compute this step: all of them if the budget allows, else as many as
    end on a multiple of `granularity` (0 when the budget left does not reach one; a whole step's
    budget always does, since max_num_batched_tokens >= block_size >= granularity)."""
    if end - start <= budget:
        return end - start
    return max((start + budget) // granularity * granularity - start, 0)


@dataclass
class Admission:
    """What admitting a sequence takes; `Admissions.match` computes it without side effects."""

    matched: list[CachedChunk]  # exact prefix chunks (their blocks are shared)
    hits: list[ContentHit]  # content matches after the prefix (their KV is copied and moved)
    num_new_tokens: int  # tokens computed at admission (with hits: the whole rest, in repair slices)
    num_new_blocks: int  # blocks to allocate
    choice: Choice | None = None  # what the content matcher decided (None: no content matches)
    # after the matched chunks: a cached chunk whose first blocks the prompt's next chunk shares, and
    # how many (KVCacheManager.match_blocks): an exact hit that ends on a block, not a chunk
    partial: tuple[CachedChunk, int] | None = None
    num_cached_tokens: int = 0  # the matched chunks' tokens and the partial hit's
    reservation: Reservation | None = None  # what `Admissions.reserve` held for it

    @property
    def sources(self) -> list[CachedChunk]:
        """The hits' chunks, each once."""
        return list({c.prefix_hash: c for h in self.hits for c in h.hit.chunks}.values())

    @property
    def held_chunks(self) -> list[CachedChunk]:
        """What `reserve` holds for it: the matched chunks, the hits' sources, the partial hit's chunk."""
        return self.matched + self.sources + ([self.partial[0]] if self.partial else [])


@dataclass
class PrefixCounters:
    """Prefix cache lookups, in prompt tokens (each sequence's first admission)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0


class Admissions:
    def __init__(
        self,
        kv: KVCacheManager,
        reuse: ContentReuse | None,
        enable_prefix_caching: bool,
    ):
        self.kv, self.reuse = kv, reuse
        self.chunk_size, self.block_size = kv.chunk_size, kv.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix = PrefixCounters()
        # each says whether a sequence waits for something of its owner's (the KV tiers: a load)
        self.waits_on: list[Callable[[Sequence], bool]] = []

    def deferred(self, seq: Sequence) -> bool:
        """It waits: for a load from a KV tier, or for chunks of its prefix another sequence computes."""
        if any(waits(seq) for waits in self.waits_on):  # e.g. its chunks load from a KV tier
            return True
        if not self.enable_prefix_caching or not self.kv.in_flight:
            return False
        for h in seq.cache.prefix_hashes[: self.max_match_chunks(seq)]:
            if h not in self.kv.store:
                return h in self.kv.in_flight
        return False

    def max_match_chunks(self, seq: Sequence) -> int:
        if seq.request.warm_only:
            return len(seq.cache.prefix_hashes)
        # a full hit still recomputes the last prompt token: its logits are needed
        num_chunks = (seq.num_tokens - 1) // self.chunk_size
        if seq.wants_prompt_logits:  # cached positions have no logits: take only KV before the unscored ones
            num_chunks = min(num_chunks, len(seq.prompt_logprobs) // self.chunk_size)
        return num_chunks

    def match(self, seq: Sequence, budget: int, granularity: int, content: bool = True) -> Admission:
        """What admitting `seq` takes; without `content`, its exact prefix hits only (no repair)."""
        matched: list[CachedChunk] = []
        if self.enable_prefix_caching:
            matched = self.kv.match(seq.cache.prefix_hashes[: self.max_match_chunks(seq)])
        num_cached = len(matched) * self.chunk_size
        choice = None
        if content and self.reuse is not None:
            choice = self.reuse.consider(seq, num_cached)
        hits = choice.plan.hits if choice is not None and choice.plan is not None else []
        partial = None
        if not hits and self._takes_partial_hits(seq):
            partial = self.kv.match_blocks(
                seq.cache.prefix_hashes, seq.token_ids, len(matched), seq.cache.root_hash, seq.num_tokens - 1
            )
        num_shared_blocks = len(matched) * self.kv.blocks_per_chunk + (partial[1] if partial else 0)
        num_cached += partial[1] * self.block_size if partial else 0
        # a repair's blocks are all allocated at admission (its rows come in position order, by pass)
        if hits:
            n = seq.num_tokens - num_cached
        else:
            n = slice_len(num_cached, seq.num_tokens, budget, granularity)
        need = cdiv(num_cached + n, self.block_size) - num_shared_blocks
        return Admission(matched, hits, n, need, choice, partial, num_cached)

    def _takes_partial_hits(self, seq: Sequence) -> bool:
        """Whether a hit may end inside a chunk: not for prompts that score their own tokens (cached
        positions have no logits), warms (they cache whole chunks) or background recomputes."""
        return (
            self.enable_prefix_caching
            and not seq.wants_prompt_logits
            and not seq.request.warm_only
            and not seq.request.background
        )

    def reserve(self, adm: Admission) -> bool:
        """Hold the matched chunks and the hits' sources (so eviction spares them) and make room for
        the new blocks (`adm.reservation`, what `start` admits with); on failure nothing is held."""
        adm.reservation = self.kv.reserve(adm.held_chunks, adm.num_new_blocks)
        return adm.reservation is not None

    def can_ever_fit(self, adm: Admission) -> bool:
        num_partial = adm.partial[1] if adm.partial else 0
        return self.kv.can_ever_fit(adm.matched, adm.sources, adm.num_new_blocks, num_partial)

    def start(self, seq: Sequence, adm: Admission) -> Repair | None:
        """Open the sequence's holding (after `reserve`) and the cache's books on it: prefix hits,
        the content choice, the chunks it will register in flight. Returns the repair it runs with
        content hits."""
        rid = seq.request_id
        num_cached = adm.num_cached_tokens
        assert adm.reservation is not None, f"start {rid} before its reservation"
        self.kv.admit(rid, adm.reservation, adm.matched, adm.sources, adm.partial)
        seq.num_computed_tokens = num_cached
        if seq.report is None:  # its first admission
            seq.report = ReuseReport(num_exact_cached_tokens=num_cached)
            self.prefix.num_query_tokens += seq.num_prompt_tokens
            self.prefix.num_hit_tokens += num_cached
        limit = None
        if adm.hits:
            # KV after the first hit is approximate: never registered, so never marked in flight
            limit = adm.hits[0].dst_start // self.chunk_size
            self.kv.limit(rid, seq.cache.prefix_hashes, limit)
        if self.enable_prefix_caching and not seq.request.background:
            # a background sequence (an audit) runs only in idle steps: a request deferred on chunks it
            # holds in flight would keep every step busy and so wait forever; it computes them itself
            self.kv.mark_in_flight(rid, seq.cache.prefix_hashes[len(adm.matched) : limit])
        return self.reuse.start(seq, adm.choice) if self.reuse is not None else None
