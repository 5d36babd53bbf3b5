"""Scheduler: continuous batching over the paged pool with exact prefix reuse.

Each step: running sequences first (decodes, unfinished prefills and content-reuse repairs, oldest
first), then admission from the prefix-grouped queue, all under the step's token budget and the
sequence cap. A long prompt is prefilled in pieces; where the KV storage encodes whole blocks (KIVI's
K), every piece but its last ends on a block boundary (`granularity`), so each token gets the same
values whichever way the prompt was cut and a request's output does not depend on the batch it ran
in. A prompt whose content matches were taken runs as a Repair (repair.py): pieces of rows at
explicit positions, scheduled like prefill pieces. With `decode_slowdown_limit`, prefill and repair
pieces beside decoding sequences get only the rows that keep the step's estimated time (cost.py)
within that multiple of the decodes' own (slowdown.py). Background sequences (the audit's recomputes) are
admitted and stepped only while nothing else runs or waits.

Admission is match (what the cache already holds, no side effects) -> reserve (hold the matched
chunks, find blocks: free, then evicted) -> start (admission.py, then `_start`). Blocks for running
sequences come from the free list, then from evicting unused cached chunks, then by preempting a
running sequence (background ones first, then the newest; its KV is recomputed later, mostly from
the cache since its completed chunks stay registered, registration.py). A sequence that could never
get its blocks because pinned chunks hold the rest of the pool is refused (the engine fails it with
the reason), never left waiting.

Ownership (invariant 3): a block's pool ref count == number of sequences holding it + 1 if a cached
chunk holds it; `check_integrity` verifies this after every step in tests.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import chunk_prefix_hashes
from kvserve.request import FinishReason
from kvserve.scheduler.admission import Admission, Admissions, cdiv, piece_len
from kvserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.cost import CostModel
from kvserve.scheduler.queue import AdmissionQueue
from kvserve.scheduler.registration import ChunkRegistrar
from kvserve.scheduler.repair import Repair, make_repair
from kvserve.scheduler.sequence import SeqStatus, Sequence
from kvserve.scheduler.slowdown import SlowdownLimit, is_decoding


@dataclass
class PrefixCounters:
    """Prefix cache lookups, in prompt tokens (each sequence's first admission)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0


# rows a background sequence computes per step: a request that arrives meanwhile waits for at most
# one such step (about 0.1 s for SmolLM2 on 2 cores) before it is scheduled
BACKGROUND_ROWS = 128


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
        granularity: int | None = None,
        cost: CostModel | None = None,
        decode_slowdown_limit: float = 0.0,
    ):
        self.pool, self.store = pool, store
        self.block_size = pool.block_size
        self.chunk_size = store.chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting = AdmissionQueue(batch_window_s)
        # background sequences (audits, Request.background): admitted and run only in idle steps
        self.background: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix = PrefixCounters()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.content = content if enable_prefix_caching else None
        self.chunks = ChunkRegistrar(store, self.content, self.chunk_size, self.block_size)
        self.admissions = Admissions(pool, store, self.content, enable_prefix_caching)
        # a prompt piece that is not its last ends on a multiple of this (the block size where the KV
        # storage encodes whole blocks, else 1: `LayerKV.per_token`)
        self.granularity = granularity or self.block_size
        self.slowdown = SlowdownLimit(decode_slowdown_limit, cost, self.granularity, max_num_batched_tokens)
        self._source_ids = itertools.count(1)

    # --- entry points ------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """Hash the prompt's chunks (and cut its content pieces) before it is checked and queued."""
        seq.cache.prefix_hashes = chunk_prefix_hashes(seq.token_ids, self.chunk_size, seq.cache.root_hash)
        seq.reuse.source_id = next(self._source_ids)
        if self.content is not None:
            self.content.prepare(seq)

    def enqueue(self, seq: Sequence) -> None:
        if seq.request.background:
            self.background.append(seq)
        else:
            self.waiting.add(seq)

    def add(self, seq: Sequence) -> None:
        self.prepare(seq)
        self.enqueue(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in [*self.waiting, *self.background]:
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.background)

    @property
    def idle(self) -> bool:
        """No request but background ones runs or waits: background sequences may have the step."""
        return not self.waiting and all(s.request.background for s in self.running)

    # --- schedule ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        idle = self.idle
        decoding = [s for s in self.running if is_decoding(s) and (idle or not s.request.background)]
        longest = max((s.num_tokens for s in [*self.running, *self.waiting]), default=0)
        prefill = self.slowdown.rows(decoding, longest)  # for prefill and repair pieces beside decodes
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted or refused earlier in this loop
                continue
            if seq.request.background and not idle:
                continue
            decode = is_decoding(seq)
            room = budget if decode else min(budget, prefill)
            if seq.request.background:
                room = min(room, BACKGROUND_ROWS)
            item: ScheduledSeq | None
            if seq.reuse.repair is not None:  # its blocks were all allocated at admission
                item = self._repair_piece(seq, seq.reuse.repair, room)
            else:
                n = piece_len(seq.kv.num_computed_tokens, seq.num_tokens, room, self.granularity)
                if n <= 0 or not self._ensure_blocks(seq, seq.kv.num_computed_tokens + n, batch):
                    continue
                sample = seq.kv.num_computed_tokens + n == seq.num_tokens and seq.generates
                item = ScheduledSeq(seq, n, sample)
            if item is not None:
                batch.items.append(item)
                budget -= item.num_new_tokens
                prefill -= 0 if decode else item.num_new_tokens
        room = min(budget, prefill)
        room = self._admit(self.waiting.candidates(now, self._is_deferred), room, batch)
        if idle:
            self._admit(iter(list(self.background)), min(room, BACKGROUND_ROWS), batch)
        return batch

    def _admit(self, candidates: Iterator[Sequence], budget: int, batch: ScheduledBatch) -> int:
        """Admit from `candidates` in order while budget, sequence slots and memory last; returns
        the budget left."""
        for seq in candidates:
            if len(self.running) >= self.max_num_seqs and not seq.request.background:
                self._preempt_background(batch)
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            admission = self.admissions.match(seq, budget, self.granularity)
            num_cached = len(admission.matched) * self.chunk_size
            if admission.num_new_tokens == 0 and num_cached < seq.num_tokens:
                break  # the budget left ends before the next block boundary: next step
            if not self._reserve(seq, admission, batch):
                if self.admissions.can_ever_fit(admission):
                    break  # wait for memory: admit nothing younger either (FCFS)
                self._refuse(seq, batch)
                continue
            item = self._start(seq, admission, budget)
            if item is not None and item.num_new_tokens:
                batch.items.append(item)
                budget -= item.num_new_tokens
        return budget

    def _reserve(self, seq: Sequence, admission: Admission, batch: ScheduledBatch) -> bool:
        """Reserve the admission's memory; a request (not background work) preempts running
        background sequences, newest first, until it fits."""
        while not self.admissions.reserve(admission):
            if seq.request.background or not self._preempt_background(batch):
                return False
        return True

    def _background_victim(self) -> Sequence | None:
        """The newest running background sequence: the first to give up its blocks."""
        return next((s for s in reversed(self.running) if s.request.background), None)

    def _preempt_background(self, batch: ScheduledBatch) -> bool:
        """Preempt the newest running background sequence (False: none runs): it steps only while no
        request runs or waits, so a request waiting on its slot or blocks would wait forever."""
        if (victim := self._background_victim()) is None:
            return False
        self.preempt(victim)
        batch.preempted.append(victim)
        return True

    def _repair_piece(self, seq: Sequence, repair: Repair, budget: int) -> ScheduledSeq | None:
        """The next rows of a content-reuse repair that fit the budget (scheduler/repair.py)."""
        rows = repair.next_piece(budget, self.granularity)
        cur = repair.current
        if not rows or cur is None:
            return None
        ends = (
            cur is repair.passes[-1]
            and cur.num_layers is None
            and cur.num_done + len(rows) == len(cur.positions)
        )
        # else re-admitted: decode rows follow
        sample = ends and seq.num_tokens == seq.num_prompt_tokens and seq.generates
        return ScheduledSeq(seq, len(rows), sample, positions=rows, num_layers=cur.num_layers)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, evicting and preempting as needed.
        False if `seq` itself had to be preempted (or refused: it can never fit)."""
        need = cdiv(num_tokens, self.block_size) - len(seq.kv.block_ids)
        while need > self.pool.num_free_blocks:
            if self.store.evict(need - self.pool.num_free_blocks):
                continue
            victim = self._background_victim() or self.running[-1]  # background work first, then the newest
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

    def _is_deferred(self, seq: Sequence) -> bool:
        if seq.cache.tier_job is not None:  # its chunks are being loaded from a KV tier
            return True
        if not self.enable_prefix_caching or not self.chunks.in_flight:
            return False
        for h in seq.cache.prefix_hashes[: self.admissions.max_match_chunks(seq)]:
            if h not in self.store:
                return h in self.chunks.in_flight
        return False

    # --- admission: match -> reserve -> start ------------------------------------------------------
    def _start(self, seq: Sequence, adm: Admission, budget: int) -> ScheduledSeq | None:
        num_cached = len(adm.matched) * self.chunk_size
        self._dequeue(seq)
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
        if adm.choice is not None:
            assert self.content is not None
            self.content.record(seq, adm.choice)
        if adm.hits:
            # KV after the first hit is approximate: never registered, so never marked in flight
            seq.cache.register_limit = adm.hits[0].dst_start // self.chunk_size
        if self.enable_prefix_caching and not seq.request.background:
            # a background sequence (an audit) runs only in idle steps: a request deferred on chunks it
            # holds in flight would keep every step busy and so wait forever; it computes them itself
            self.chunks.mark_in_flight(
                seq, seq.cache.prefix_hashes[len(adm.matched) : seq.cache.register_limit]
            )
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if adm.choice is not None and adm.choice.plan is not None:
            assert self.content is not None
            repair = make_repair(adm.choice.plan, seq.num_prompt_tokens, self.content.cost.num_layers)
            seq.reuse.repair = repair
            return self._repair_piece(seq, repair, budget)
        sample = num_cached + adm.num_new_tokens == seq.num_tokens and seq.generates
        return ScheduledSeq(seq, adm.num_new_tokens, sample)

    def repair_done(self, seq: Sequence) -> None:
        """The repair's last pass is computed: the prompt's KV is complete; release the hit sources."""
        repair = seq.reuse.repair
        assert repair is not None and repair.finished
        for h in {c.prefix_hash for hit in repair.plan.hits for c in hit.hit.chunks}:
            seq.cache.used_chunks.remove(h)
            self.store.release(h)
        self.num_prompt_tokens_computed += len(repair.fresh)
        seq.kv.num_computed_tokens = seq.num_prompt_tokens
        seq.reuse.repair = None
        self.chunks.register(seq)

    # --- update ------------------------------------------------------------------------------------
    def on_computed(self, item: ScheduledSeq) -> None:
        """The step computed item.num_new_tokens tokens of the sequence: register completed chunks.
        A repair piece only advances its pass (the engine ends the repair: `repair_done`)."""
        seq = item.seq
        if item.positions is not None:
            assert seq.reuse.repair is not None
            seq.reuse.repair.computed(item.num_new_tokens)
            return
        start = seq.kv.num_computed_tokens
        self.num_prompt_tokens_computed += max(
            0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start
        )
        seq.kv.num_computed_tokens += item.num_new_tokens
        if self.enable_prefix_caching:
            self.chunks.register(seq)

    # --- leaving -----------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        for h in seq.cache.used_chunks:
            self.store.release(h)
        self.pool.release(seq.kv.block_ids)
        self.chunks.drop_in_flight(seq)
        seq.kv.block_ids, seq.cache.used_chunks = [], []
        seq.cache.num_chunks_in_store = 0
        seq.reuse.repair = None  # a preempted repair is planned again at re-admission
        seq.kv.num_computed_tokens = 0

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self._dequeue(seq)
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
        if seq.request.background:
            self.background.appendleft(seq)
        else:
            self.waiting.add(seq, front=True)

    def _dequeue(self, seq: Sequence) -> None:
        if seq.request.background:
            self.background.remove(seq)
        else:
            self.waiting.remove(seq)

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.store.check_integrity()
        expected = [0] * self.pool.num_blocks
        for seq in self.running:
            assert len(seq.kv.block_ids) >= cdiv(seq.kv.num_computed_tokens, self.block_size)
            for b in seq.kv.block_ids:
                expected[b] += 1
        for chunk in self.store.chunks():
            for b in chunk.block_ids:
                expected[b] += 1
        for seq in [*self.waiting, *self.background]:
            assert not seq.kv.block_ids, "a waiting sequence holds blocks"
            assert not seq.cache.used_chunks and not seq.cache.in_flight, "a waiting sequence holds chunks"
        assert expected == self.pool.ref_counts, "pool ref counts do not match owners"
        users = Counter(h for seq in self.running for h in seq.cache.used_chunks)
        for chunk in self.store.chunks():
            assert chunk.num_users == users.get(chunk.prefix_hash, 0), "chunk user count mismatch"
        flying = Counter(h for seq in self.running for h in seq.cache.in_flight)
        assert flying == self.chunks.in_flight, "in-flight chunks do not match the running sequences"
        if self.content is not None:
            self.content.index.check_integrity()
