"""Admission of a waiting sequence, step one and two of match -> reserve -> start (Scheduler._start
is the third): what the cache already holds for it and what it needs (`match`, no side effects),
then holding that and finding the blocks (`reserve`), or telling that it never can (`can_ever_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.scheduler.batch import ContentHit
from kvserve.scheduler.content import Choice, ContentMatcher
from kvserve.scheduler.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def piece_len(start: int, end: int, budget: int, granularity: int) -> int:
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
    num_new_tokens: int  # tokens computed at admission (with hits: the whole rest, in repair pieces)
    num_new_blocks: int  # blocks to allocate
    choice: Choice | None = None  # what the content matcher decided (None: no content matches)

    @property
    def sources(self) -> list[CachedChunk]:
        """The hits' chunks, each once."""
        return list({c.prefix_hash: c for h in self.hits for c in h.hit.chunks}.values())


class Admissions:
    def __init__(
        self, pool: BlockPool, store: ChunkStore, content: ContentMatcher | None, enable_prefix_caching: bool
    ):
        self.pool, self.store, self.content = pool, store, content
        self.chunk_size, self.block_size = store.chunk_size, pool.block_size
        self.enable_prefix_caching = enable_prefix_caching

    def max_match_chunks(self, seq: Sequence) -> int:
        if seq.request.warm_only:
            return len(seq.cache.prefix_hashes)
        # a full hit still recomputes the last prompt token: its logits are needed
        num_chunks = (seq.num_tokens - 1) // self.chunk_size
        if seq.wants_prompt_logits:  # cached positions have no logits: take only KV before the unscored ones
            num_chunks = min(num_chunks, len(seq.out.prompt_logprobs) // self.chunk_size)
        return num_chunks

    def num_blocks_available_to(self, matched: list[CachedChunk]) -> int:
        """Blocks a sequence sharing `matched` could ever hold: all but other pinned chunks' blocks."""
        shared_pinned = sum(len(c.block_ids) for c in matched if c.pinned)
        return self.pool.num_blocks - self.store.num_pinned_blocks + shared_pinned

    def match(self, seq: Sequence, budget: int, granularity: int) -> Admission:
        matched: list[CachedChunk] = []
        if self.enable_prefix_caching:
            matched = self.store.match_prefix(seq.cache.prefix_hashes[: self.max_match_chunks(seq)])
        num_cached = len(matched) * self.chunk_size
        choice = None
        if self.content is not None and self.content.wants(seq):
            choice = self.content.consider(seq, num_cached)
        hits = choice.plan.hits if choice is not None and choice.plan is not None else []
        # a repair's blocks are all allocated at admission (its rows come in position order, by pass)
        if hits:
            n = seq.num_tokens - num_cached
        else:
            n = piece_len(num_cached, seq.num_tokens, budget, granularity)
        need = cdiv(num_cached + n, self.block_size) - len(matched) * self.store.blocks_per_chunk
        return Admission(matched, hits, n, need, choice)

    def reserve(self, adm: Admission) -> bool:
        """Hold the matched chunks and the hits' sources (so eviction spares them) and make room for
        the new blocks; on failure undo and return False."""
        held = adm.matched + adm.sources
        for chunk in held:
            self.store.acquire(chunk)
        if adm.num_new_blocks > self.pool.num_free_blocks:
            self.store.evict(adm.num_new_blocks - self.pool.num_free_blocks)
        if adm.num_new_blocks <= self.pool.num_free_blocks:
            return True
        for chunk in held:
            self.store.release(chunk.prefix_hash)
        return False

    def can_ever_fit(self, adm: Admission) -> bool:
        """Whether the blocks it holds at admission (shared prefix, new blocks, and the content-hit
        sources it holds while their KV is copied) fit beside the chunks other owners pinned."""
        matched = {c.prefix_hash for c in adm.matched}
        sources = [c for c in adm.sources if c.prefix_hash not in matched and not c.pinned]
        blocks = len(adm.matched) * self.store.blocks_per_chunk + adm.num_new_blocks
        blocks += sum(len(c.block_ids) for c in sources)
        return blocks <= self.num_blocks_available_to(adm.matched)
