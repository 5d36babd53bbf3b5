"""Scheduler: continuous batching over the paged pool with exact prefix reuse.

Each step: running sequences first (decodes, unfinished prefills and content-reuse repairs, oldest
first), then admission from the prefix-grouped queue, all under the step's token budget and the
sequence cap. A long prompt is prefilled in slices (its rows of one step); where the KV storage encodes whole blocks (KIVI's
K), every slice but its last ends on a block boundary (`granularity`), so each token gets the same
values whichever way the prompt was cut and a request's output does not depend on the batch it ran
in. A prompt whose content matches were taken runs as a Repair (repair.py): slices of rows at
explicit positions, scheduled like prefill slices. With `decode_slowdown_limit`, prefill and repair
slices beside decoding sequences get only the rows that keep the step's estimated time (cost.py)
within that multiple of the decodes' own (slowdown.py). Background sequences (the audit's recomputes) are
admitted and stepped only while nothing else runs or waits, BACKGROUND_ROWS rows a step for all of them.

Admission is match (what the cache already holds, no side effects) -> reserve (hold the matched
chunks, find blocks: free, then evicted) -> start (admission.py, the KVCacheManager, then `_start`).
The scheduler decides; the KVCacheManager (kvcache/manager.py) keeps every block and chunk a
sequence holds. Blocks for running sequences come from the free list, then from evicting unused
cached chunks, then by preempting a running sequence (background ones first, then the newest; its
KV is recomputed later, mostly from the cache since its completed chunks stay registered). What
computed KV adds to the cache is registration.py's. A content-reuse repair takes every block of its
prompt at admission and holds its hits' sources (whose ancestors eviction cannot take either): when
that memory is not there, the sequence is admitted computed exactly (prefill slices need one step's
blocks). A sequence that could never get its blocks because pinned chunks hold the rest of the pool,
or that cannot be admitted while nothing runs to free a block, is refused (the engine fails it with
the reason), never left waiting.

Ownership (invariant 3) is the manager's to keep; `check_integrity` verifies it after every step in tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvserve.kvcache.hashing import chunk_prefix_hashes
from kvserve.kvcache.manager import KVCacheManager
from kvserve.request import FinishReason
from kvserve.reuse import ContentReuse, CostModel, Repair
from kvserve.scheduler.admission import Admission, Admissions, slice_len
from kvserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from kvserve.scheduler.queue import AdmissionQueue
from kvserve.scheduler.registration import ChunkRegistrar
from kvserve.scheduler.sequence import SeqStatus, Sequence
from kvserve.scheduler.slowdown import SlowdownLimit, is_decoding

# rows of background work one step computes, for every background sequence together (running ones
# and admissions): a request that arrives meanwhile waits for at most one such step, however many
# audits are queued (about 0.1 s for SmolLM2 on 2 cores) before it is scheduled
BACKGROUND_ROWS = 128


@dataclass(frozen=True)
class SchedulerStats:
    num_query_tokens: int  # prompt tokens looked up in the prefix cache
    num_hit_tokens: int  # of those, found
    num_preemptions: int
    num_running: int  # client requests only; background sequences (audits) are counted apart
    num_waiting: int
    num_prompt_tokens_computed: int
    # background sequences (audits' full recomputes): running (admitted in idle steps) and waiting
    num_background_running: int
    num_background_waiting: int


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batch_window_s: float = 0.0,
        enable_prefix_caching: bool = True,
        reuse: ContentReuse | None = None,
        granularity: int | None = None,
        cost: CostModel | None = None,
        decode_slowdown_limit: float = 0.0,
        group_window_s: float = float("inf"),
    ):
        self.kv = kv
        self.block_size = kv.block_size
        self.chunk_size = kv.chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting = AdmissionQueue(batch_window_s, group_window_s)
        # background sequences (audits, Request.background): admitted and run only in idle steps
        self.background: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.reuse = reuse if enable_prefix_caching else None  # content reuse (kvserve/reuse/)
        self.chunks = ChunkRegistrar(kv, self.reuse, enable_prefix_caching)
        self.admissions = Admissions(kv, self.reuse, enable_prefix_caching)
        # a prefill slice that is not its prompt's last ends on a multiple of this (the block size where the KV
        # storage encodes whole blocks, else 1: `LayerKV.per_token`)
        self.granularity = granularity or self.block_size
        self.slowdown = SlowdownLimit(decode_slowdown_limit, cost, self.granularity, max_num_batched_tokens)
        self.on_enqueue: list[Callable[[Sequence], None]] = []  # each new request (the KV tiers' lookup)

    # --- entry points ------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """Hash the prompt's chunks before it is checked and queued."""
        seq.cache.prefix_hashes = chunk_prefix_hashes(seq.token_ids, self.chunk_size, seq.cache.root_hash)

    def enqueue(self, seq: Sequence) -> None:
        """Queue a checked sequence (its content pieces are cut now: they are kept until it finishes)."""
        if self.reuse is not None:
            self.reuse.prepare(seq)
        if seq.request.background:
            self.background.append(seq)
            return
        self.waiting.add(seq)
        for hook in self.on_enqueue:
            hook(seq)

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
        prefill = self._prefill_rows(idle)  # for prefill and repair slices beside decodes
        background_rows = BACKGROUND_ROWS if idle else 0  # left for all background sequences together
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted or refused earlier in this loop
                continue
            if seq.request.background and background_rows == 0:
                continue
            repair = self._repair(seq)
            decode = is_decoding(seq, repair)
            room = budget if decode else min(budget, prefill)
            if seq.request.background:
                room = min(room, background_rows)
            item: ScheduledSeq | None
            if repair is not None:  # blocks allocated at admission
                item = self._repair_slice(seq, repair, room)
            else:
                n = slice_len(seq.num_computed_tokens, seq.num_tokens, room, self.granularity)
                if n <= 0 or not self._ensure_blocks(seq, seq.num_computed_tokens + n, batch):
                    continue
                sample = seq.num_computed_tokens + n == seq.num_tokens and seq.generates
                item = self._item(seq, n, sample)
            if item is not None:
                batch.items.append(item)
                budget -= item.num_new_tokens
                prefill -= 0 if decode else item.num_new_tokens
                background_rows -= item.num_new_tokens if seq.request.background else 0
        room = min(budget, prefill)
        room = self._admit(self.waiting.candidates(now, self.admissions.deferred), room, batch)
        if background_rows:
            self._admit(iter(list(self.background)), min(room, background_rows), batch)
        return batch

    def _prefill_rows(self, idle: bool) -> int:
        """The rows prefill and repair slices may take this step (SlowdownLimit; the whole budget when
        the limit is off, without a walk over the running sequences)."""
        if not self.slowdown.active:
            return self.max_num_batched_tokens
        decoding = [
            s for s in self.running if is_decoding(s, self._repair(s)) and (idle or not s.request.background)
        ]
        longest = max((s.num_tokens for s in [*self.running, *self.waiting]), default=0)
        return self.slowdown.rows(decoding, longest)

    def _admit(self, candidates: Iterator[Sequence], budget: int, batch: ScheduledBatch) -> int:
        """Admit from `candidates` in order while budget, sequence slots and memory last; returns
        the budget left."""
        for seq in candidates:
            if len(self.running) >= self.max_num_seqs and not seq.request.background:
                self._preempt_background(batch)
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            admission = self.admissions.match(seq, budget, self.granularity)
            if admission.num_new_tokens == 0 and admission.num_cached_tokens < seq.num_tokens:
                break  # the budget left ends before the next block boundary: next step
            if not self._reserve(seq, admission, batch):
                if admission.hits:  # a repair's memory is not there: the sequence computed exactly instead
                    admission = self.admissions.match(seq, budget, self.granularity, content=False)
                    if admission.num_new_tokens == 0 and admission.num_cached_tokens < seq.num_tokens:
                        break
                if not self._reserve(seq, admission, batch):
                    if self.admissions.can_ever_fit(admission) and (self.running or batch.items):
                        break  # wait for memory: admit nothing younger either (FCFS)
                    self._refuse(seq, batch)  # never fits, or nothing runs that could free a block
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

    def _repair(self, seq: Sequence) -> Repair | None:
        """The content-reuse repair the sequence is running, if any."""
        return self.reuse.repair(seq.request_id) if self.reuse is not None else None

    def _repair_slice(self, seq: Sequence, repair: Repair, budget: int) -> ScheduledSeq | None:
        """The next rows of a content-reuse repair that fit the budget (reuse/repair.py)."""
        rows = repair.next_slice(budget, self.granularity)
        if not rows or (cur := repair.current) is None:
            return None
        sample = repair.completes_prompt(rows) and seq.num_tokens == seq.num_prompt_tokens and seq.generates
        item = self._item(seq, len(rows), sample)
        item.positions, item.num_layers, item.repair = rows, cur.num_layers, repair
        return item

    def _item(self, seq: Sequence, num_new_tokens: int, sample: bool) -> ScheduledSeq:
        return ScheduledSeq(seq, num_new_tokens, sample, block_tables=self.kv.block_tables(seq.request_id))

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, evicting and preempting as needed.
        False if `seq` itself had to be preempted (or refused: it can never fit)."""
        while not self.kv.grow(seq.request_id, num_tokens):
            victim = self._background_victim() or self.running[-1]  # background work first, then the newest
            if victim is seq and len(self.running) == 1:
                # alone and still short: only pinned chunks hold the rest of the pool
                self._refuse(seq, batch)
                return False
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _refuse(self, seq: Sequence, batch: ScheduledBatch) -> None:
        reason = self.kv.never_fits_reason()
        self.finish(seq, FinishReason.ERROR, reason)
        batch.refused.append((seq, reason))

    # --- admission: match -> reserve -> start ------------------------------------------------------
    def _start(self, seq: Sequence, adm: Admission, budget: int) -> ScheduledSeq | None:
        self._dequeue(seq)
        repair = self.admissions.start(seq, adm)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if repair is not None:
            return self._repair_slice(seq, repair, budget)
        sample = seq.num_computed_tokens + adm.num_new_tokens == seq.num_tokens and seq.generates
        return self._item(seq, adm.num_new_tokens, sample)

    # --- leaving -----------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id)
        if self.reuse is not None:
            self.reuse.drop(seq.request_id)  # a preempted repair is planned again at re-admission
        seq.num_computed_tokens = 0

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            if reason != FinishReason.ERROR:
                self.chunks.register_blocks(seq)
        elif seq.status == SeqStatus.WAITING:
            self._dequeue(seq)
        else:
            return
        self._release(seq)
        if self.reuse is not None:
            self.reuse.forget(seq.request_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def preempt(self, seq: Sequence) -> None:
        """Give up the sequence's blocks; it waits at its place by arrival (before every request that
        came later) and is recomputed (prompt and generated tokens) when re-admitted."""
        self.running.remove(seq)
        self._release(seq)
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        if seq.request.background:
            self.background.appendleft(seq)
        else:
            self.waiting.add(seq)  # at its place by arrival (queue.py)

    def _dequeue(self, seq: Sequence) -> None:
        if seq.request.background:
            self.background.remove(seq)
        else:
            self.waiting.remove(seq)

    def reset(self) -> None:
        """Forget every sequence and repair without giving back what they hold: for the engine's
        rebuild after a failed step, which starts the KVCacheManager over (KVCacheManager.reset)."""
        for seq in [*self.running, *self.waiting, *self.background]:
            seq.status = SeqStatus.FINISHED
        for seq in list(self.waiting):
            self.waiting.remove(seq)
        self.running.clear()
        self.background.clear()

    # --- facts -------------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        background = sum(seq.request.background for seq in self.running)
        return SchedulerStats(
            num_query_tokens=self.admissions.prefix.num_query_tokens,
            num_hit_tokens=self.admissions.prefix.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_running=len(self.running) - background,
            num_waiting=len(self.waiting),
            num_prompt_tokens_computed=self.chunks.num_prompt_tokens_computed,
            num_background_running=background,
            num_background_waiting=len(self.background),
        )

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for seq in self.running:
            assert len(self.kv.block_ids(seq.request_id)) >= -(-seq.num_computed_tokens // self.block_size)
        self.kv.check_integrity(running := [s.request_id for s in self.running])
        if self.reuse is not None:
            assert self.reuse.request_ids()["repairs"] <= set(running), (
                "a repair kept for a sequence not running"
            )
            self.reuse.check_integrity()
