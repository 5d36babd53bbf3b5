"""Scheduler: continuous batching over the paged pool with exact prefix reuse.

Each step: running sequences first (decodes and unfinished prefills, oldest first), then admission
from the prefix-grouped queue, all under the step's token budget (long prompts are prefilled in
pieces) and the sequence cap. Blocks come from the free list, then from evicting unused cached
chunks, then by preempting the newest running sequence (its KV is recomputed later, mostly from the
cache since its completed chunks stay registered).

Ownership (invariant 3): a block's pool ref count == number of sequences holding it + 1 if a cached
chunk holds it; `check_integrity` verifies this after every step in tests.
"""

from __future__ import annotations

import itertools
from collections import Counter

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes, prompt_chunk_hashes, tail_hash
from kvserve.request import FinishReason
from kvserve.scheduler.batch import BlendPlan, ContentHit, ScheduledBatch, ScheduledSeq
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.queue import AdmissionQueue
from kvserve.scheduler.sequence import SeqStatus, Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        store: ChunkStore,
        namespace: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batch_window_s: float = 0.0,
        enable_prefix_caching: bool = True,
        content: ContentMatcher | None = None,
    ):
        self.pool, self.store = pool, store
        self.namespace = namespace
        self.block_size = pool.block_size
        self.chunk_size = store.chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting = AdmissionQueue(batch_window_s)
        self.running: list[Sequence] = []
        self.in_flight: Counter[bytes] = Counter()  # prompt chunks being computed right now
        # prefix cache counters, in prompt tokens (first admission of each sequence)
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_preemptions = 0
        self.content = content if enable_prefix_caching else None
        self._source_ids = itertools.count(1)

    # --- entry points ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.prefix_hashes = chunk_prefix_hashes(seq.token_ids, self.chunk_size, seq.root_hash)
        seq.source_id = next(self._source_ids)
        if self.content is not None:
            self.content.prepare(seq)
        self.waiting.add(seq)

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

    # --- schedule ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0 or not self._ensure_blocks(seq, seq.num_computed_tokens + n, batch):
                continue
            sample = seq.num_computed_tokens + n == seq.num_tokens and not seq.request.warm_only
            batch.items.append(ScheduledSeq(seq, n, sample))
            budget -= n
        for seq in self.waiting.candidates(now, self._is_deferred):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            item = self._admit(seq, budget)
            if item is None:
                break  # no memory: admit nothing younger either (FCFS)
            if isinstance(item, BlendPlan):
                batch.blends.append(item)
                budget -= min(budget, seq.num_tokens - item.prefix_len)
            elif item.num_new_tokens:
                batch.items.append(item)
                budget -= item.num_new_tokens
        return batch

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, evicting and preempting as needed.
        False if `seq` itself had to be preempted."""
        need = _cdiv(num_tokens, self.block_size) - len(seq.block_ids)
        while need > self.pool.num_free_blocks:
            if self.store.evict(need - self.pool.num_free_blocks):
                continue
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def _max_match_chunks(self, seq: Sequence) -> int:
        if seq.request.warm_only:
            return len(seq.prefix_hashes)
        # a full hit still recomputes the last prompt token: its logits are needed
        return (seq.num_tokens - 1) // self.chunk_size

    def _is_deferred(self, seq: Sequence) -> bool:
        if not self.enable_prefix_caching or not self.in_flight:
            return False
        for h in seq.prefix_hashes[: self._max_match_chunks(seq)]:
            if h not in self.store:
                return h in self.in_flight
        return False

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | BlendPlan | None:
        matched: list[CachedChunk] = []
        if self.enable_prefix_caching:
            matched = self.store.match_prefix(seq.prefix_hashes[: self._max_match_chunks(seq)])
        num_cached = len(matched) * self.chunk_size
        hits: list[ContentHit] = []
        if self.content is not None and self.content.wants(seq):
            hits = self.content.find_hits(seq, num_cached)
        # acquire first: matched chunks and hit sources cannot be evicted below
        sources = {c.prefix_hash: c for h in hits for c in h.hit.chunks}
        held = matched + list(sources.values())
        for chunk in held:
            self.store.acquire(chunk)
        for chunk in matched:
            self.pool.retain(chunk.block_ids)
        n = seq.num_tokens - num_cached if hits else min(seq.num_tokens - num_cached, budget)
        need = _cdiv(num_cached + n, self.block_size) - len(matched) * self.store.blocks_per_chunk
        if need > self.pool.num_free_blocks:
            self.store.evict(need - self.pool.num_free_blocks)
        if need > self.pool.num_free_blocks:
            for chunk in held:
                self.store.release(chunk.prefix_hash)
            for chunk in matched:
                self.pool.release(chunk.block_ids)
            return None
        self.waiting.remove(seq)
        seq.block_ids = [b for chunk in matched for b in chunk.block_ids] + self.pool.allocate(need)
        seq.used_chunks = [chunk.prefix_hash for chunk in held]
        seq.num_chunks_in_store = len(matched)
        seq.num_computed_tokens = num_cached
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.num_cached_tokens = num_cached
            self.num_query_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += num_cached
        if self.enable_prefix_caching:
            seq.in_flight = seq.prefix_hashes[len(matched) :]
            self.in_flight.update(seq.in_flight)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if hits:
            assert self.content is not None
            seq.register_limit = hits[0].dst_start // self.chunk_size  # KV after the first hit is approximate
            return self.content.plan(seq, num_cached, hits)
        sample = num_cached + n == seq.num_tokens and not seq.request.warm_only
        return ScheduledSeq(seq, n, sample)

    def blend_done(self, plan: BlendPlan) -> None:
        """The repair forward ran: the prompt's KV is complete; release the hit sources."""
        seq = plan.seq
        for h in {c.prefix_hash for hit in plan.hits for c in hit.hit.chunks}:
            seq.used_chunks.remove(h)
            self.store.release(h)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._register_chunks(seq)

    # --- update ------------------------------------------------------------------------------------
    def on_computed(self, item: ScheduledSeq) -> None:
        """The step computed item.num_new_tokens tokens of the sequence: register completed chunks."""
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if self.enable_prefix_caching:
            self._register_chunks(seq)

    def _register_chunks(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.chunk_size
        if seq.register_limit is not None:
            num_full = min(num_full, seq.register_limit)
        if len(seq.prefix_hashes) < num_full:  # chunks made of generated tokens
            parent = seq.prefix_hashes[-1] if seq.prefix_hashes else seq.root_hash
            seq.prefix_hashes += chunk_prefix_hashes(
                seq.token_ids[: num_full * self.chunk_size], self.chunk_size, parent, len(seq.prefix_hashes)
            )
        bpc = self.store.blocks_per_chunk
        for i in range(seq.num_chunks_in_store, num_full):
            h = seq.prefix_hashes[i]
            if h not in self.store:
                self.store.insert(h, seq.block_ids[i * bpc : (i + 1) * bpc], i)
                seq.used_chunks.append(h)
            # else: computed concurrently by another sequence; ours stays private and is freed at the end
            self._drop_in_flight(seq, h)
        seq.num_chunks_in_store = max(seq.num_chunks_in_store, num_full)
        if self.content is not None:
            num_cached = seq.num_chunks_in_store * self.chunk_size
            self.content.register(seq, num_cached, seq.prefix_hashes[: seq.num_chunks_in_store])

    def register_tail(self, seq: Sequence) -> None:
        """Cache the prompt's final piece shorter than a chunk (warmed documents), for content matches."""
        full = seq.num_prompt_tokens // self.chunk_size
        tail_len = seq.num_prompt_tokens - full * self.chunk_size
        if (
            self.content is None
            or not tail_len
            or seq.num_chunks_in_store < full
            or seq.register_limit is not None
        ):
            return
        parent = seq.prefix_hashes[full - 1] if full else seq.root_hash
        tokens = seq.token_ids[full * self.chunk_size : seq.num_prompt_tokens]
        h = tail_hash(parent, tokens)
        if h not in self.store:
            first = full * self.store.blocks_per_chunk
            blocks = seq.block_ids[first : first + _cdiv(tail_len, self.block_size)]
            self.store.insert(h, blocks, full, tail_len)
            seq.used_chunks.append(h)
        self.content.register(seq, seq.num_prompt_tokens, seq.prefix_hashes[:full] + [h])

    def _drop_in_flight(self, seq: Sequence, h: bytes) -> None:
        if h in seq.in_flight:
            seq.in_flight.remove(h)
            self.in_flight[h] -= 1
            if self.in_flight[h] <= 0:
                del self.in_flight[h]

    def pin_prefix(self, seq: Sequence, pinned: bool = True) -> int:
        """Pin (or unpin) the cached chunks of the sequence's prompt; returns how many."""
        hashes = prompt_chunk_hashes(seq.request.prompt_token_ids, self.chunk_size, seq.root_hash)
        return sum(self.store.set_pinned(h, pinned) for h in hashes)

    # --- leaving -----------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        for h in seq.used_chunks:
            self.store.release(h)
        self.pool.release(seq.block_ids)
        for h in list(seq.in_flight):
            self._drop_in_flight(seq, h)
        seq.block_ids, seq.used_chunks = [], []
        seq.num_chunks_in_store = 0

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq, front=True)

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.store.check_integrity()
        expected = [0] * self.pool.num_blocks
        for seq in self.running:
            assert len(seq.block_ids) >= _cdiv(seq.num_computed_tokens, self.block_size)
            for b in seq.block_ids:
                expected[b] += 1
        for chunk in self.store.chunks():
            for b in chunk.block_ids:
                expected[b] += 1
        for seq in self.waiting:
            assert not seq.block_ids, "a waiting sequence holds blocks"
        assert expected == self.pool.ref_counts, "pool ref counts do not match owners"
        users = Counter(h for seq in self.running for h in seq.used_chunks)
        for chunk in self.store.chunks():
            assert chunk.num_users == users.get(chunk.prefix_hash, 0), "chunk user count mismatch"
