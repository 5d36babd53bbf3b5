"""Scheduler: continuous batching over the paged pool with exact prefix reuse.

Each step: running sequences first (decodes and unfinished prefills, oldest first), then admission
from the prefix-grouped queue, all under the step's token budget and the sequence cap. A long prompt
is prefilled in pieces, and every piece but its last ends on a block boundary (`_piece_len`): a KV
format that encodes a block when it fills (KIVI) then gives each token the same values whichever way
the prompt was cut, so a request's output does not depend on the batch it ran in. Admission is match (what the cache already holds, no side effects) ->
reserve (hold the matched chunks, find blocks: free, then evicted) -> start. Blocks for running
sequences come from the free list, then from evicting unused cached chunks, then by preempting the
newest running sequence (its KV is recomputed later, mostly from the cache since its completed chunks
stay registered). A sequence that could never get its blocks because pinned chunks hold the rest of
the pool is refused (the engine fails it with the reason), never left waiting.

Ownership (invariant 3): a block's pool ref count == number of sequences holding it + 1 if a cached
chunk holds it; `check_integrity` verifies this after every step in tests.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes, tail_hash
from kvserve.request import FinishReason
from kvserve.scheduler.batch import BlendPlan, ContentHit, ScheduledBatch, ScheduledSeq
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.queue import AdmissionQueue
from kvserve.scheduler.sequence import SeqStatus, Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Admission:
    """What admitting a sequence takes; `Scheduler._match` computes it without side effects."""

    matched: list[CachedChunk]  # exact prefix chunks (their blocks are shared)
    hits: list[ContentHit]  # content matches after the prefix (their KV is copied and moved)
    num_new_tokens: int  # tokens computed at admission (the whole rest of the prompt with hits)
    num_new_blocks: int  # blocks to allocate

    @property
    def sources(self) -> list[CachedChunk]:
        """The hits' chunks, each once."""
        return list({c.prefix_hash: c for h in self.hits for c in h.hit.chunks}.values())


@dataclass
class PrefixCounters:
    """Prefix cache lookups, in prompt tokens (each sequence's first admission)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        store: ChunkStore,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batch_window_s: float = 0.0,
        enable_prefix_caching: bool = True,
        content: ContentMatcher | None = None,
    ):
        self.pool, self.store = pool, store
        self.block_size = pool.block_size
        self.chunk_size = store.chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting = AdmissionQueue(batch_window_s)
        self.running: list[Sequence] = []
        self.in_flight: Counter[bytes] = Counter()  # prompt chunks being computed right now
        self.prefix = PrefixCounters()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.content = content if enable_prefix_caching else None
        self._source_ids = itertools.count(1)

    # --- entry points ------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """Hash the prompt's chunks (and cut its content pieces) before it is checked and queued."""
        seq.cache.prefix_hashes = chunk_prefix_hashes(seq.token_ids, self.chunk_size, seq.cache.root_hash)
        seq.reuse.source_id = next(self._source_ids)
        if self.content is not None:
            self.content.prepare(seq)

    def enqueue(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def add(self, seq: Sequence) -> None:
        self.prepare(seq)
        self.enqueue(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def num_blocks_available_to(self, matched: list[CachedChunk]) -> int:
        """Blocks a sequence sharing `matched` could ever hold: all but other pinned chunks' blocks."""
        shared_pinned = sum(len(c.block_ids) for c in matched if c.pinned)
        return self.pool.num_blocks - self.store.num_pinned_blocks + shared_pinned

    # --- schedule ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted or refused earlier in this loop
                continue
            n = self._piece_len(seq.kv.num_computed_tokens, seq.num_tokens, budget)
            if n <= 0 or not self._ensure_blocks(seq, seq.kv.num_computed_tokens + n, batch):
                continue
            sample = seq.kv.num_computed_tokens + n == seq.num_tokens and not seq.request.warm_only
            batch.items.append(ScheduledSeq(seq, n, sample))
            budget -= n
        for seq in self.waiting.candidates(now, self._is_deferred):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            admission = self._match(seq, budget)
            if admission.num_new_tokens == 0 and len(admission.matched) * self.chunk_size < seq.num_tokens:
                break  # the budget left ends before the next block boundary: next step
            if not self._reserve(admission):
                if self._can_ever_fit(seq, admission):
                    break  # wait for memory: admit nothing younger either (FCFS)
                self._refuse(seq, batch)
                continue
            item = self._start(seq, admission)
            if isinstance(item, BlendPlan):
                batch.blends.append(item)
                budget -= min(budget, seq.num_tokens - item.prefix_len)
            elif item.num_new_tokens:
                batch.items.append(item)
                budget -= item.num_new_tokens
        return batch

    def _piece_len(self, start: int, end: int, budget: int) -> int:
        """Tokens of [start, end) to compute this step: all of them if the budget allows, else as
        many as end on a block boundary (0 when the budget left does not reach one; a whole step's
        budget always does, since max_num_batched_tokens >= block_size)."""
        if end - start <= budget:
            return end - start
        return max((start + budget) // self.block_size * self.block_size - start, 0)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, evicting and preempting as needed.
        False if `seq` itself had to be preempted (or refused: it can never fit)."""
        need = _cdiv(num_tokens, self.block_size) - len(seq.kv.block_ids)
        while need > self.pool.num_free_blocks:
            if self.store.evict(need - self.pool.num_free_blocks):
                continue
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                # alone and still short: only pinned chunks hold the rest of the pool
                self._refuse(seq, batch)
                return False
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.kv.block_ids.extend(self.pool.allocate(need))
        return True

    def _refuse(self, seq: Sequence, batch: ScheduledBatch) -> None:
        held = self.store.num_pinned_blocks
        reason = (
            f"the request needs more KV blocks than can ever be free: {held} of the pool's "
            f"{self.pool.num_blocks} blocks are pinned; unpin warmed text (DELETE /v1/warm) or lower max_tokens"
        )
        self.finish(seq, FinishReason.ERROR, reason)
        batch.refused.append((seq, reason))

    def _max_match_chunks(self, seq: Sequence) -> int:
        if seq.request.warm_only:
            return len(seq.cache.prefix_hashes)
        # a full hit still recomputes the last prompt token: its logits are needed
        return (seq.num_tokens - 1) // self.chunk_size

    def _is_deferred(self, seq: Sequence) -> bool:
        if not self.enable_prefix_caching or not self.in_flight:
            return False
        for h in seq.cache.prefix_hashes[: self._max_match_chunks(seq)]:
            if h not in self.store:
                return h in self.in_flight
        return False

    # --- admission: match -> reserve -> start ------------------------------------------------------
    def _match(self, seq: Sequence, budget: int) -> Admission:
        matched: list[CachedChunk] = []
        if self.enable_prefix_caching:
            matched = self.store.match_prefix(seq.cache.prefix_hashes[: self._max_match_chunks(seq)])
        num_cached = len(matched) * self.chunk_size
        hits: list[ContentHit] = []
        if self.content is not None and self.content.wants(seq):
            hits = self.content.find_hits(seq, num_cached)
        # a prompt with content matches is prefilled by one forward of its own (not chunked)
        n = seq.num_tokens - num_cached if hits else self._piece_len(num_cached, seq.num_tokens, budget)
        need = _cdiv(num_cached + n, self.block_size) - len(matched) * self.store.blocks_per_chunk
        return Admission(matched, hits, n, need)

    def _reserve(self, adm: Admission) -> bool:
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

    def _can_ever_fit(self, seq: Sequence, adm: Admission) -> bool:
        """Whether the blocks it holds at admission (shared prefix, new blocks, and the content-hit
        sources it holds while their KV is copied) fit beside the chunks other owners pinned."""
        matched = {c.prefix_hash for c in adm.matched}
        sources = [c for c in adm.sources if c.prefix_hash not in matched and not c.pinned]
        blocks = len(adm.matched) * self.store.blocks_per_chunk + adm.num_new_blocks
        blocks += sum(len(c.block_ids) for c in sources)
        return blocks <= self.num_blocks_available_to(adm.matched)

    def _start(self, seq: Sequence, adm: Admission) -> ScheduledSeq | BlendPlan:
        num_cached = len(adm.matched) * self.chunk_size
        self.waiting.remove(seq)
        for chunk in adm.matched:
            self.pool.retain(chunk.block_ids)
        seq.kv.block_ids = [b for c in adm.matched for b in c.block_ids] + self.pool.allocate(
            adm.num_new_blocks
        )
        seq.kv.num_computed_tokens = num_cached
        seq.cache.used_chunks = [c.prefix_hash for c in adm.matched + adm.sources]
        seq.cache.num_chunks_in_store = len(adm.matched)
        if not seq.reuse.admitted_once:
            seq.reuse.admitted_once = True
            seq.reuse.num_exact_cached_tokens = num_cached
            self.prefix.num_query_tokens += seq.num_prompt_tokens
            self.prefix.num_hit_tokens += num_cached
        if adm.hits:
            # KV after the first hit is approximate: never registered, so never marked in flight
            seq.cache.register_limit = adm.hits[0].dst_start // self.chunk_size
        if self.enable_prefix_caching:
            seq.cache.in_flight = seq.cache.prefix_hashes[len(adm.matched) : seq.cache.register_limit]
            self.in_flight.update(seq.cache.in_flight)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if adm.hits:
            assert self.content is not None
            return self.content.plan(seq, num_cached, adm.hits)
        sample = num_cached + adm.num_new_tokens == seq.num_tokens and not seq.request.warm_only
        return ScheduledSeq(seq, adm.num_new_tokens, sample)

    def blend_done(self, plan: BlendPlan, num_fresh_tokens: int) -> None:
        """The repair forward ran (computing `num_fresh_tokens` prompt tokens that were not reused):
        the prompt's KV is complete; release the hit sources."""
        seq = plan.seq
        for h in {c.prefix_hash for hit in plan.hits for c in hit.hit.chunks}:
            seq.cache.used_chunks.remove(h)
            self.store.release(h)
        self.num_prompt_tokens_computed += num_fresh_tokens
        seq.kv.num_computed_tokens = seq.num_prompt_tokens
        self._register_chunks(seq)

    # --- update ------------------------------------------------------------------------------------
    def on_computed(self, item: ScheduledSeq) -> None:
        """The step computed item.num_new_tokens tokens of the sequence: register completed chunks."""
        seq = item.seq
        start = seq.kv.num_computed_tokens
        self.num_prompt_tokens_computed += max(
            0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start
        )
        seq.kv.num_computed_tokens += item.num_new_tokens
        if self.enable_prefix_caching:
            self._register_chunks(seq)

    def _register_chunks(self, seq: Sequence) -> None:
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
                self.store.insert(h, seq.kv.block_ids[i * bpc : (i + 1) * bpc], i, parent)
            else:
                # computed concurrently by another sequence: ours stays private, but hold the cached
                # copy so it stays the parent of the chunks this sequence registers next
                self.store.acquire(chunk, hit=False)
            cache.used_chunks.append(h)
            self._drop_in_flight(seq, h)
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

    def _drop_in_flight(self, seq: Sequence, h: bytes) -> None:
        if h in seq.cache.in_flight:
            seq.cache.in_flight.remove(h)
            self.in_flight[h] -= 1
            if self.in_flight[h] <= 0:
                del self.in_flight[h]

    # --- leaving -----------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        for h in seq.cache.used_chunks:
            self.store.release(h)
        self.pool.release(seq.kv.block_ids)
        for h in list(seq.cache.in_flight):
            self._drop_in_flight(seq, h)
        seq.kv.block_ids, seq.cache.used_chunks = [], []
        seq.cache.num_chunks_in_store = 0
        seq.kv.num_computed_tokens = 0

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.out.finish_reason = reason
        seq.out.error = error

    def preempt(self, seq: Sequence) -> None:
        """Give up the sequence's blocks; it waits at the front of the queue and is recomputed (prompt
        and generated tokens) when re-admitted."""
        self.running.remove(seq)
        self._release(seq)
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq, front=True)

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.store.check_integrity()
        expected = [0] * self.pool.num_blocks
        for seq in self.running:
            assert len(seq.kv.block_ids) >= _cdiv(seq.kv.num_computed_tokens, self.block_size)
            for b in seq.kv.block_ids:
                expected[b] += 1
        for chunk in self.store.chunks():
            for b in chunk.block_ids:
                expected[b] += 1
        for seq in self.waiting:
            assert not seq.kv.block_ids, "a waiting sequence holds blocks"
            assert not seq.cache.used_chunks and not seq.cache.in_flight, "a waiting sequence holds chunks"
        assert expected == self.pool.ref_counts, "pool ref counts do not match owners"
        users = Counter(h for seq in self.running for h in seq.cache.used_chunks)
        for chunk in self.store.chunks():
            assert chunk.num_users == users.get(chunk.prefix_hash, 0), "chunk user count mismatch"
        flying = Counter(h for seq in self.running for h in seq.cache.in_flight)
        assert flying == self.in_flight, "in-flight chunks do not match the running sequences"
        if self.content is not None:
            self.content.index.check_integrity()
