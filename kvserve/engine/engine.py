"""Engine: the requests in flight and one step over them, read top-down:

  schedule  timeouts, tier loads, then the scheduler's batch (scheduler/scheduler.py)
  execute   the batch through the model, one sequence at a time if the batch fails (execute.py)
  update    computed rows advance the cache's books; sampled rows get their token (update.py)
  emit      the finished requests' final outputs and the others' deltas (output.py)

Requests come in through intake.py (every check in one place) and leave through `finish`. One
request can never hurt another: a fault while processing one sequence fails that request alone.

Not thread-safe: one thread drives it (LLM directly, AsyncEngine through its worker thread).
"""

from __future__ import annotations

import logging
import time
from collections import ChainMap
from collections.abc import Iterable

import torch

from kvserve.config import ServeConfig
from kvserve.engine.builder import build_parts, build_reuse, build_scheduler
from kvserve.engine.execute import StepExecute
from kvserve.engine.intake import Intake
from kvserve.engine.integrity import IntegrityError, check_books
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output import OutputProcessor
from kvserve.engine.pins import WarmPins
from kvserve.engine.precision import PRECISIONS, PrecisionPolicy
from kvserve.engine.requests import RequestRecord
from kvserve.engine.stats import EngineStats, fields_of
from kvserve.engine.update import StepUpdate
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.manager import KVCacheManager
from kvserve.request import FinishReason, Request, RequestOutput, warm_request
from kvserve.reuse import CostModel
from kvserve.scheduler.batch import ScheduledBatch
from kvserve.scheduler.sequence import Sequence
from kvserve.structured import GrammarCompiler
from kvserve.tiers.engine_side import IDLE_SWEEP_S, EngineTiers, build_tiers

log = logging.getLogger("kvserve.engine")


class Engine:
    def __init__(self, config: ServeConfig):
        self.config = config
        parts = build_parts(config)
        self.model, self.tokenizer, self.info = parts.model, parts.tokenizer, parts.info
        self.layers, self.storages = parts.layers, parts.storages
        self.kv = KVCacheManager.create(
            config.cache_config, self.info.num_blocks, [s.on_block_freed for s in self.storages], parts.layout
        )
        self.pool, self.store = self.kv.pool, self.kv.store
        self.pins = WarmPins(self.kv, config.chunk_size, config.block_size, config.max_pinned_fraction)
        device = torch.device(self.info.device)
        self.cost = CostModel.of(self.model.config, len(self.layers))
        self.reuse = build_reuse(config, parts, self.kv, self.cost)
        per_token = all(layer.per_token for layer in self.layers)
        self.scheduler = build_scheduler(config, self.kv, self.reuse, self.cost, per_token)
        tiers = build_tiers(config.tier_config, self.kv, self.layers, self.info)
        self.tiers = EngineTiers(tiers, self.scheduler, config.demote_after_s) if tiers else None
        self.runner = ModelRunner(
            self.model,
            self.layers,
            parts.backend,
            device,
            parts.fused,
            vocab_size=self.info.vocab_size,
            layout=parts.layout,
        )
        self.precision = PrecisionPolicy(config.model_config)
        self.outputs = OutputProcessor(self.tokenizer, self.info.eos_token_ids, self.info.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.info.vocab_size, self.info.eos_token_ids)
        self.intake = Intake(
            config, self.info, self.kv, self.scheduler, self.reuse, self.precision, self.grammars, self.pins
        )
        # one record per request in flight (engine/requests.py): served ones, and audits' full
        # recomputes (no client sees them)
        self._records: dict[str, RequestRecord] = {}
        self._background: dict[str, RequestRecord] = {}
        self._pending: list[RequestOutput] = []
        self.num_steps = 0
        self.check_integrity_each_step = False  # tests: verify pool ownership after every step
        self.num_step_failures = 0  # steps that raised (recover)
        self.num_restarts = 0  # rebuilds of the KV state after a failed step left the books disagreeing
        self.last_restart_reason = ""
        every = ChainMap(self._records, self._background)  # each record, served or an audit's, by id
        self.execute = StepExecute(
            self,
            self.runner,
            self.reuse,
            self.precision,
            self.scheduler.chunks,
            self.cost,
            config.chunk_size,
            every,
        )
        self.update = StepUpdate(
            self, self.scheduler, self.reuse, self.outputs, self.precision, self.grammars, every
        )

    # --- intake ------------------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[Request], checked: bool = False) -> None:
        """Add all or none: when one is refused, the ones already added are aborted (their final
        outputs come from the next step) and the refusal is raised."""
        added: list[str] = []
        try:
            for request in requests:
                self.add_request(request, checked)
                added.append(request.request_id)
        except BaseException:
            for request_id in added:
                self.abort_request(request_id, "another request of the same call was refused")
            raise

    def add_request(self, request: Request, checked: bool = False) -> None:
        """Validate and queue. Raises InvalidRequestError (the engine state is unchanged then).
        `checked`: the caller ran `check_request` (the server does, before it queues)."""
        if not checked:
            self.intake.check(request)
        self.intake.check_grammar(request)
        rid = request.request_id
        if rid in self._records or any(out.request_id == rid for out in self._pending):
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        record = self.intake.sequence(request)
        seq = record.seq
        record.stream = self.outputs.open(seq)
        self._records[rid] = record
        self.scheduler.enqueue(seq)
        if request.warm_only and not request.prompt_token_ids:
            self.finish(seq, FinishReason.STOP)

    def check_request(self, request: Request) -> None:
        """The checks that need no engine state (engine/intake.py): safe from any thread."""
        self.intake.check(request)

    def unpin(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Release the pins a warm of this text holds (at any weight precision); returns how many
        chunks it pinned (0: none)."""
        precisions: list[str | None] = list(PRECISIONS) if self.precision.nested else [None]
        return sum(self.pins.unpin(self.intake.root(cache_salt, p), token_ids) for p in precisions)

    # --- aborts ------------------------------------------------------------------------------------
    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        record = self._records.get(request_id)
        if record is None:
            return False
        self.finish(record.seq, FinishReason.ABORT, error=reason)
        return True

    def abort_all(self, reason: str = "aborted") -> int:
        """Abort every unfinished request (their final outputs come with the next step); returns how many."""
        records = list(self._records.values())
        for record in records + list(self._background.values()):
            self.finish(record.seq, FinishReason.ABORT, error=reason)
        return len(records)

    def fail_all(self, error: str) -> int:
        """Finish every request and background sequence with `error`: as failed, not aborted, so no
        request's KV is cached on its way out (a failed step may have left it half written). Returns how
        many requests; a finish that raises leaves its request behind (`recover` rebuilds then)."""
        records = list(self._records.values())
        for record in records + list(self._background.values()):
            try:
                self.finish(record.seq, FinishReason.ERROR, error=error)
            except Exception:
                log.exception("failing request %s raised", record.request_id)
        return len(records)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, outputs not yet returned, or background work (run while idle)."""
        return bool(self._records) or bool(self._pending) or bool(self._background)

    @property
    def idle_wakeup_s(self) -> float | None:
        """How often `housekeeping` must run while no request does (None: never)."""
        return IDLE_SWEEP_S if self.tiers is not None and self.config.demote_after_s > 0 else None

    def housekeeping(self) -> None:
        """Work due while idle: demoting chunks idle past --demote-after-s."""
        if self.tiers is not None:
            self.tiers.housekeeping(time.monotonic())

    def flush_tiers(self, timeout_s: float = 30.0) -> bool:
        """Wait until the KV tiers' writes queued so far are stored (any thread); False on timeout."""
        return self.tiers is None or self.tiers.tiers.flush(timeout_s)

    def close(self, write_hot: bool = True) -> None:
        """Store the KV tiers' queued writes and, with `write_hot`, the hot chunks the disk tier lacks
        (--kv-disk-shutdown-write-s; it reads the pool: only while no step runs); stop their threads."""
        if self.tiers is not None:
            self.tiers.tiers.close(write_hot=write_hot)

    def run_background(self) -> None:
        """Step until the background work (audits) is done: for callers that drive the engine
        themselves (LLM, benchmarks); the server's loop runs it whenever it is idle."""
        while self._background and not self._records:
            self.step()

    def add_background(self, request: Request) -> None:
        record = self.intake.background(request)
        self._background[request.request_id] = record
        self.scheduler.enqueue(record.seq)

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> emit."""
        now = time.monotonic()
        batch = self._schedule(now)
        touched: list[Sequence] = []
        for items, rows in self.execute.run(batch.items) if batch.items else []:
            touched += self.update.apply(items, rows)
        self._end_prompt_only()
        self.num_steps += 1
        if self.check_integrity_each_step:
            self.check_integrity()
        return self._emit(touched)

    def _schedule(self, now: float) -> ScheduledBatch:
        """Timeouts, the weight precision's load signal and the KV tiers' loads first; then the batch."""
        self._expire(now)
        self.precision.update(len(self.scheduler.waiting), now)
        if self.tiers is not None:
            self.tiers.before_schedule(now)
        batch = self.scheduler.schedule(now)
        for seq, reason in batch.refused:
            self.finish(seq, FinishReason.ERROR, error=reason)
        for seq in [item.seq for item in batch.items]:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        return batch

    def _end_prompt_only(self) -> None:
        """Warms and max_tokens=0 requests end when their prompt is computed."""
        for seq in [s for s in self.scheduler.running if s.num_computed_tokens >= len(s.token_ids)]:
            if seq.request.warm_only:
                self._finish_warm(seq)
            elif not seq.generates:
                self.finish(seq, FinishReason.LENGTH)  # max_tokens=0: only the prompt was asked for

    def _emit(self, touched: list[Sequence]) -> list[RequestOutput]:
        """The finished requests' final outputs, then a delta for each other request the step advanced
        (none for final_only requests: their final output carries everything)."""
        outputs, self._pending = self._pending, []
        seen: set[str] = set()
        for seq in touched:
            request = seq.request
            if seq.request_id in seen or seq.finished or request.background or request.final_only:
                continue  # finished ones were queued in _pending; background ones have no client
            seen.add(seq.request_id)
            record = self._records[seq.request_id]
            assert record.stream is not None
            out = self.outputs.delta(seq, record.stream, self.precision.served_at(record))
            if out is not None:
                outputs.append(out)
        return outputs

    # --- leaving (StepHost) ------------------------------------------------------------------------
    def fail(self, seq: Sequence, stage: str, exc: Exception) -> None:
        log.error("request %s failed while %s", seq.request_id, stage, exc_info=exc)
        self.finish(seq, FinishReason.ERROR, error=f"internal error while {stage}: {type(exc).__name__}")

    def _finish_warm(self, seq: Sequence) -> None:
        open_block = self.scheduler.chunks.register_tail(seq)
        for storage in self.storages:  # the cached tail's last block will never fill: encode it now
            storage.seal(open_block)
        booking = self._records[seq.request_id].pin
        error = self.pins.pin(seq, booking) if booking is not None else None
        self.finish(seq, FinishReason.STOP if error is None else FinishReason.ERROR, error=error)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.request.background:  # done (the auditor recorded it), or ended early: failed, aborted
            if self._background.pop(seq.request_id, None) is not None:  # its record goes with it
                self.scheduler.finish(seq, reason, error)
                self.reuse.background_done(seq.request_id)
            return
        record = self._records.get(seq.request_id)
        if record is None or record.seq is not seq:  # already finished
            return
        rid = seq.request_id
        audit = self.reuse.finished(seq, reason != FinishReason.ERROR, record.last_precision)
        if audit is not None:
            self.add_background(audit)
        self.scheduler.finish(seq, reason, error)  # a no-op for one the scheduler finished (refused)
        if record.pin is not None:
            self.pins.release(record.pin)
        if self.tiers is not None:
            self.tiers.forget(rid)
        seq.request.metrics.finished_time = time.monotonic()
        del self._records[rid]  # the record, and what each part kept in it
        assert record.stream is not None
        self._pending.append(self.outputs.final(seq, record.stream, self.precision.served_at(record)))

    def _expire(self, now: float) -> None:
        timeout = self.config.request_timeout_s
        # background audits are not timed: no client waits on them, they run only while the engine is
        # idle (so under steady load they wait longer than any timeout), and at most MAX_PENDING of
        # them hold memory (reuse/audit.py). Timing them dropped every audit queued more than
        # request_timeout_s before the first idle moment.
        for record in list(self._records.values()):
            if now - record.seq.request.metrics.arrival_time > timeout:
                self.finish(record.seq, FinishReason.ABORT, error="timeout")

    # --- after a failed step -----------------------------------------------------------------------
    def recover(self, exc: Exception) -> bool:
        """`step` raised `exc` (a bug: model and per-request faults are caught inside it), and the
        caller failed every request in flight (`fail_all`, so their clients hear before a rebuild).
        The books are checked: whole, the engine carries on (False); not, or a request could not be
        failed, it rebuilds its state (True), the reason naming what disagreed."""
        self.num_step_failures += 1
        left = set(self._records) | set(self._background)
        try:
            self.check_integrity()
            if not left:
                return False
            problems = [f"requests that could not be failed ({', '.join(sorted(left)[:3])})"]
        except IntegrityError as e:
            problems = e.problems
        self.rebuild(f"{type(exc).__name__} in a step; " + "; ".join(problems))
        return True

    def rebuild(self, reason: str) -> None:
        """Start the engine's state over (`reason`: what disagreed): every request forgotten, every
        block freed, every cached chunk dropped (the KV tiers keep what they hold on disk and in
        Redis), then the pinned texts warmed and pinned again (from a KV tier where one holds them).
        Raises IntegrityError if the books still disagree after that."""
        log.error("rebuilding the engine's state: %s", reason)
        self.num_restarts += 1
        self.last_restart_reason = reason
        texts = self.pins.texts()
        self._start_over()
        try:
            for i, text in enumerate(texts):
                rid = f"rewarm-{self.num_restarts}-{i}"
                request = warm_request(rid, text.token_ids, pin=True, cache_salt=text.cache_salt)
                request.weight_precision = text.weight_precision
                self.add_request(request)
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.error is not None:
                        log.warning("a pinned text was not pinned again: %s", out.error)
        except Exception:
            log.exception("warming the pinned texts again failed: they are no longer pinned")
            self._start_over()
        self.check_integrity()

    def _start_over(self) -> None:
        """Every owner forgets every request (nothing is released one by one: the counts are what
        failed); the KV cache manager starts over with every block free."""
        self.scheduler.reset()
        self.reuse.reset()
        if self.tiers is not None:
            self.tiers.reset()
        self._records.clear()  # each record, and what each part kept in it
        self._background.clear()
        self._pending.clear()
        self.kv.reset()
        self.pins.reset()

    # --- facts -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The owners' books agree: blocks and chunks, pin bookings and pinned texts, and every table
        kept by request id holds only requests in flight. Raises one IntegrityError naming each owner
        or table that disagrees."""
        check_books(self.scheduler, self.pins, self.reuse, self.tiers, self._records, self._background)

    def stats(self) -> EngineStats:
        """Each part's own report, put together (one pass over the cached chunks)."""
        info = self.info
        pool, store = self.kv.stats(info.bytes_per_token * info.block_size, self.config.max_cache_bytes)
        held, decoded, reused = (
            sum(x) for x in zip(*(s.decoded_stats() for s in self.storages), strict=True)
        )
        return EngineStats(
            model=self.config.model,
            kv_codec=info.kv_codec,
            bytes_per_token=info.bytes_per_token,
            pool=pool,
            store=store,
            content_reuse=self.reuse.stats(),
            **fields_of(self.scheduler.stats()),
            num_generated_tokens=self.outputs.num_generated_tokens,
            num_steps=self.num_steps,
            weights=self.precision.stats(info.weight_bytes, info.num_params),
            tiers=self.tiers.stats(store) if self.tiers is not None else [],
            decoded_bytes=held,
            num_decoded_blocks=decoded,
            num_decoded_reused=reused,
            num_step_failures=self.num_step_failures,
            num_engine_restarts=self.num_restarts,
            last_restart_reason=self.last_restart_reason,
        )
