"""Engine: step() = schedule -> execute -> update, plus request intake, aborts and pins.

One request can never hurt another: a fault while processing one sequence (sampling, detokenizing,
stop checks, moving a content match's KV in) fails that request alone; a fault in a batched forward is
retried sequence by sequence, so only the sequence that causes it fails. Everything else stays as it
would have been without the fault.

Every step's wall time and work (scheduler/cost.py) feed the cost model that content reuse plans with.

Not thread-safe: one thread drives it (LLM directly, AsyncEngine through its worker thread).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable

import torch

from kvserve.config import ServeConfig
from kvserve.engine.audit import Auditor
from kvserve.engine.builder import (
    build_parts,
    check_content_reuse,
    check_reuse_request,
    require_content_reuse,
)
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output import OutputProcessor
from kvserve.engine.pins import WarmPins
from kvserve.engine.precision import PRECISIONS, PrecisionPolicy
from kvserve.engine.prompt_logprobs import record
from kvserve.engine.repair import Repairer
from kvserve.engine.sampler import sample_one
from kvserve.engine.stats import EngineStats
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import root_hash
from kvserve.kvcache.piece_index import PieceIndex
from kvserve.kvcache.pieces import line_end_ids
from kvserve.request import FinishReason, Request, RequestOutput, check_token_ids
from kvserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.cost import CostModel
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import SeqCache, SeqOutput, Sequence
from kvserve.structured import GrammarCompiler
from kvserve.tiers.engine_side import IDLE_SWEEP_S, EngineTiers, build_tiers
from kvserve.tokenizer import IncrementalDetokenizer

log = logging.getLogger("kvserve.engine")


class Engine:
    def __init__(self, config: ServeConfig):
        self.config = config
        parts = build_parts(config)
        self.model, self.tokenizer, self.info = parts.model, parts.tokenizer, parts.info
        self.layers = parts.layers
        self.pool = BlockPool(self.info.num_blocks, config.block_size)
        for layer in self.layers:
            self.pool.on_free.append(layer.on_block_freed)
        max_pinned = int(config.max_pinned_fraction * self.info.num_blocks)
        self.store = ChunkStore(self.pool, config.chunk_size, config.eviction_policy, max_pinned)
        self.pins = WarmPins(self.store, config.chunk_size, config.block_size, config.max_pinned_fraction)
        device = torch.device(self.info.device)
        rotator, reason = check_content_reuse(self.model)
        self.cost = CostModel.of(self.model.config, len(self.layers))
        line_ends = line_end_ids(self.tokenizer.token_texts()) if config.pieces == "lines" else frozenset()
        self.content = ContentMatcher(
            config, PieceIndex(self.store), self.cost, rotator is not None, reason, line_ends
        )
        self.repairer = Repairer(self.layers, rotator, device) if rotator else None
        require_content_reuse(config.reuse, rotator, reason)
        if config.reuse == "any" and config.recompute_strategy == "auto" and self.content.verified is None:
            log.warning(
                "--reuse any: no repair is verified to keep task accuracy on %s (docs/blend.md), so "
                "content matches are served exactly; name one (--recompute-strategy, or a request's "
                "recompute_strategy) to opt into its measured loss",
                config.model,
            )
        self.scheduler = Scheduler(
            self.pool,
            self.store,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.batch_window_ms / 1000.0,
            config.enable_prefix_caching,
            self.content,
            granularity=1 if all(layer.per_token for layer in self.layers) else config.block_size,
            cost=self.cost,
            decode_slowdown_limit=config.decode_slowdown_limit,
        )
        tiers = build_tiers(config, self.store, self.layers, self.info)
        self.tiers = EngineTiers(tiers, self.scheduler, config.demote_after_s) if tiers else None
        self.runner = ModelRunner(
            self.model, self.layers, parts.backend, device, parts.fused, vocab_size=self.info.vocab_size
        )
        self.precision = PrecisionPolicy(config)
        self.outputs = OutputProcessor(self.info.eos_token_ids, self.info.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.info.vocab_size, self.info.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self.auditor = Auditor(config.audit_rate, config.audit_max_kl, config.seed, config.audit_tokens)
        self._background: dict[str, Sequence] = {}  # audits' full recomputes (no client sees them)
        self._pending: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.check_integrity_each_step = False  # tests: verify pool ownership after every step
        self.logits_sink: dict[str, list[torch.Tensor]] | None = None  # tests: raw logits per request

    # --- intake ------------------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[Request]) -> None:
        """Add all or none: when one is refused, the ones already added are aborted (their final
        outputs come from the next step) and the refusal is raised."""
        added: list[str] = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except BaseException:
            for request_id in added:
                self.abort_request(request_id, "another request of the same call was refused")
            raise

    def add_request(self, request: Request) -> None:
        """Validate and queue. Raises InvalidRequestError (the engine state is unchanged then)."""
        self._validate(request)
        precision = request.weight_precision or self.precision.assign(
            len(self.scheduler.waiting), time.monotonic()
        )
        root = self.root(request.cache_salt, precision)
        pin_owner = (
            WarmPins.owner(root, request.prompt_token_ids) if request.warm_only and request.pin else None
        )
        if request.warm_only and not self.content.enabled:  # only whole chunks can be prefix-matched
            usable = len(request.prompt_token_ids) // self.config.chunk_size * self.config.chunk_size
            request.prompt_token_ids = request.prompt_token_ids[:usable]
        params = request.sampling_params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        detokenizer = (
            None if request.warm_only else IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        )
        seq = self._new_sequence(request, root, seed, detokenizer)
        seq.precision = precision
        seq.pin_owner = pin_owner
        if params.structured is not None and not request.warm_only:
            seq.grammar = self.grammars.matcher(params.structured)
        self._check_capacity(seq)
        if seq.pin_owner is not None:
            self.pins.reserve(seq)
        self._seqs[request.request_id] = seq
        self.scheduler.enqueue(seq)
        if request.warm_only and not request.prompt_token_ids:
            self._finish(seq, FinishReason.STOP)

    def check_request(self, request: Request) -> None:
        """The checks that need no engine state (the model's context, vocabulary, pool size and reuse
        support): safe from any thread, so the server runs them before it queues a request."""
        n = len(request.prompt_token_ids)
        limit = self.info.max_model_len
        if not request.warm_only:
            check_reuse_request(
                request.reuse, self.content.enabled, self.content.disabled_reason, self.config.reuse
            )
        if n == 0 and not request.warm_only:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        if n >= limit and not request.warm_only:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the model's context is {limit}: "
                f"shorten it to at most {limit - 1} tokens so one can be generated",
                param="prompt",
            )
        if n > limit:
            raise InvalidRequestError(
                f"the text has {n} tokens; at most {limit} can be warmed", param="prompt"
            )
        if request.weight_precision is not None and (
            not self.precision.nested or request.weight_precision not in PRECISIONS
        ):
            raise InvalidRequestError(
                f"weight_precision {request.weight_precision!r} is not served here (server: "
                f"--weight-precision {self.config.weight_precision})",
                param="weight_precision",
            )
        check_token_ids(request.prompt_token_ids, self.info.vocab_size, "prompt")
        request.sampling_params.check_vocab(self.info.vocab_size)
        structured = request.sampling_params.structured
        if structured is not None and not request.warm_only:
            if request.sampling_params.ignore_eos:
                raise InvalidRequestError(
                    f"ignore_eos cannot be combined with {structured.source}: a structured output ends "
                    "when its document is complete; drop ignore_eos",
                    param="ignore_eos",
                )
        need_tokens = n if request.warm_only else min(n + request.sampling_params.max_tokens, limit)
        if -(-need_tokens // self.config.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need_tokens} tokens of KV but the pool holds {self.info.pool_tokens}; "
                "raise max_cache_bytes or lower max_tokens",
                param="max_tokens",
            )

    def _validate(self, request: Request) -> None:
        self.check_request(request)
        structured = request.sampling_params.structured
        if structured is not None and not request.warm_only:
            # an invalid schema is a 400; AsyncEngine compiled it on GrammarWorker's threads, LLM here
            self.grammars.check(structured)
        rid = request.request_id
        if rid in self._seqs or any(out.request_id == rid for out in self._pending):
            raise InvalidRequestError(f"request id {rid!r} is already in use")

    def _check_capacity(self, seq: Sequence) -> None:
        """The request's KV at its longest must fit in what the pool can ever free for it beside the
        chunks warmed texts pinned (check_request checked the pool's size)."""
        request = seq.request
        need_tokens = min(seq.num_prompt_tokens + request.sampling_params.max_tokens, self.info.max_model_len)
        if request.warm_only:
            need_tokens = seq.num_prompt_tokens
        need_blocks = -(-need_tokens // self.config.block_size)
        matched = self.store.match_prefix(seq.cache.prefix_hashes)
        available = self.scheduler.admissions.num_blocks_available_to(matched)
        if need_blocks > available:
            raise InvalidRequestError(
                f"the request needs {need_blocks} KV blocks but only {available} of the pool's "
                f"{self.pool.num_blocks} can be free: {self.store.num_pinned_blocks} are pinned by warmed "
                "text; unpin some (DELETE /v1/warm) or lower max_tokens",
                param="max_tokens",
            )

    def root(self, cache_salt: str | None, precision: str | None) -> bytes:
        """The root of a request's chunk hashes: the engine's namespace, the weight precision its KV is
        computed at (NestedFP), its cache salt."""
        namespace = self.info.namespace if precision is None else f"{self.info.namespace}|{precision}"
        return root_hash(namespace, cache_salt)

    def unpin(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Release the pins a warm of this text holds (at any weight precision); returns how many
        chunks it pinned (0: none)."""
        precisions: list[str | None] = list(PRECISIONS) if self.precision.nested else [None]
        return sum(self.pins.unpin(self.root(cache_salt, p), token_ids) for p in precisions)

    # --- aborts ------------------------------------------------------------------------------------
    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT, error=reason)
        return True

    def abort_all(self, reason: str = "aborted") -> int:
        """Abort every unfinished request (their final outputs come with the next step); returns how many."""
        seqs = list(self._seqs.values())
        for seq in seqs + list(self._background.values()):
            self._finish(seq, FinishReason.ABORT, error=reason)
        return len(seqs)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, outputs not yet returned, or background work (run while idle)."""
        return bool(self._seqs) or bool(self._pending) or bool(self._background)

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
        while self._background and not self._seqs:
            self.step()

    def _new_sequence(
        self, request: Request, root: bytes, seed: int, detokenizer: IncrementalDetokenizer | None
    ) -> Sequence:
        """A sequence for `request`, its prompt hashed and cut (Scheduler.prepare), not yet queued."""
        seq = Sequence(request, torch.Generator().manual_seed(seed), SeqCache(root), SeqOutput(detokenizer))
        self.scheduler.prepare(seq)
        return seq

    def _add_background(self, request: Request) -> None:
        seq = self._new_sequence(request, self.root(request.cache_salt, request.weight_precision), 0, None)
        seq.precision = request.weight_precision
        self._background[request.request_id] = seq
        self.scheduler.enqueue(seq)

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        self._expire(now)
        self.precision.update(len(self.scheduler.waiting), now)
        if self.tiers is not None:
            self.tiers.before_schedule(now)
        batch = self.scheduler.schedule(now)
        for seq, reason in batch.refused:
            self._finish(seq, FinishReason.ERROR, error=reason)
        for seq in [item.seq for item in batch.items]:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        touched: list[Sequence] = []
        if batch.items:
            touched += self._execute_items(batch.items)
        for seq in list(self.scheduler.running):
            if seq.request.warm_only and seq.kv.num_computed_tokens >= seq.num_tokens:
                self._finish_warm(seq)
            elif not seq.generates and seq.kv.num_computed_tokens >= seq.num_tokens:
                self._finish(seq, FinishReason.LENGTH)  # max_tokens=0: only the prompt was asked for
        self.num_steps += 1
        if self.check_integrity_each_step:
            self.check_integrity()
        outputs, self._pending = self._pending, []
        seen: set[str] = set()
        for seq in touched:
            if seq.request_id in seen or seq.finished or seq.request.background:
                continue  # finished ones were queued in _pending; background ones have no client
            seen.add(seq.request_id)
            out = self.outputs.delta(seq)
            if out is not None:
                outputs.append(out)
        return outputs

    def _execute_items(self, items: list[ScheduledSeq]) -> list[Sequence]:
        start = time.perf_counter()
        moved = 0
        for item in list(items):
            repair = item.seq.reuse.repair
            if repair is not None and not repair.moved:  # a repair's first piece
                assert self.repairer is not None
                try:
                    moved += self.repairer.begin(item.seq)
                except Exception as e:
                    self._fail(item.seq, "moving its content matches' KV", e)
                    items.remove(item)
                    continue
            if repair is not None and self.repairer is not None:
                item.probe = self.repairer.probe(item)
        if not items:
            return []
        self.precision.apply(items, self.scheduler.chunks, self.config.chunk_size)
        try:
            batch = ScheduledBatch(items=items)
            inputs = self.runner.prepare_inputs(batch)
            step = self.runner.execute(batch, inputs)
        except Exception:  # find the sequence that causes it: the others must not fail with it
            log.exception("a batched forward of %d sequences failed; retrying them one by one", len(items))
            return self._execute_one_by_one(items)
        inputs.work.moved = moved
        self.cost.observe(inputs.work, time.perf_counter() - start)
        record(step.prompt_logprobs)
        return self._update(items, step.logits)

    def _execute_one_by_one(self, items: list[ScheduledSeq]) -> list[Sequence]:
        touched: list[Sequence] = []
        for item in items:
            try:
                step = self.runner.execute(ScheduledBatch(items=[item]))
            except Exception as e:
                self._fail(item.seq, "running the model", e)
                continue
            record(step.prompt_logprobs)
            touched += self._update([item], step.logits)
        return touched

    def _update(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[Sequence]:
        """logits [num_sampled, vocab]: one row per item with item.sample, in order. Sampling runs on
        the CPU (each request's seeded CPU generator, grammar masks, penalties): on a GPU the step's
        logits come over in one transfer."""
        logits = logits.cpu()
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for item in items:
            self.scheduler.on_computed(item)
            row += item.sample
            if item.positions is not None and not self._advance_repair(item.seq):
                continue
            if item.sample:
                to_sample.append((item.seq, logits[row - 1]))
        masks = self._grammar_masks([seq for seq, _ in to_sample])
        for seq, seq_logits in to_sample:
            if not seq.finished:  # a failed grammar mask fails its sequence
                self._sample(seq, seq_logits, masks.get(seq.request_id))
        return [item.seq for item in items]

    def _grammar_masks(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """request id -> bool [vocab] allowed next tokens, for the structured-output sequences among
        `seqs`, filled in one batched call; free sequences cost nothing."""
        constrained = [(seq, seq.grammar) for seq in seqs if seq.grammar is not None]
        if not constrained:
            return {}
        try:
            allowed = self.grammars.allowed_tokens([grammar for _, grammar in constrained])
        except Exception as e:
            for seq, _ in constrained:
                self._fail(seq, "computing its grammar mask", e)
            return {}
        return {seq.request_id: allowed[i] for i, (seq, _) in enumerate(constrained)}

    def _advance_repair(self, seq: Sequence) -> bool:
        """After a repair piece: CacheBlend's selection when its first pass ends, the end of the
        repair after its last. False if that failed (the request is failed)."""
        repair, repairer = seq.reuse.repair, self.repairer
        assert repair is not None and repairer is not None
        try:
            if repair.awaits_selection:
                repairer.select(seq)
            if not repair.finished:
                return True
            report = repairer.finish(seq)
        except Exception as e:
            self._fail(seq, "repairing its reused KV", e)
            return False
        self.scheduler.repair_done(seq)
        self.content.num_hit_tokens += report.num_reused_tokens
        self.content.num_recomputed_tokens += report.num_recomputed_tokens
        return True

    def _sample(self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        if seq.request.background:
            self._audit_step(seq, logits)
            return
        if seq.reuse.strategy is not None and seq.num_output_tokens == 0 and self.auditor.wants(seq):
            self.auditor.start(seq)
        params = seq.request.sampling_params
        stage = "sampling"
        try:
            history = seq.output_token_ids if params.penalizes_history else []
            token, logprob = sample_one(
                logits, params, seq.request.prompt_token_ids, history, seq.generator, allowed
            )
            if seq.grammar is not None:
                stage = "following its grammar"
                seq.grammar.accept(token)
            if self.logits_sink is not None:
                self.logits_sink.setdefault(seq.request_id, []).append(logits.clone())
            if seq.request.metrics.first_token_time is None:
                metrics = seq.request.metrics
                metrics.first_token_time = time.monotonic()
                self.precision.observe_ttft(
                    metrics.first_token_time - metrics.arrival_time, metrics.first_token_time
                )
            audit = self.auditor.observe(seq, logits, token)
            if audit is not None:
                self._add_background(audit)
            stage = "processing its output"
            reason = self.outputs.append(seq, token, logprob)
        except Exception as e:
            self._fail(seq, stage, e)
            return
        if reason is None and seq.grammar is not None and seq.grammar.ends(seq.out.text):
            reason = FinishReason.STOP  # the document is complete (only end-of-sequence could follow)
        if reason is not None:
            self._finish(seq, reason)

    def _audit_step(self, seq: Sequence, logits: torch.Tensor) -> None:
        """An audit's recompute has the full prefill's logits at the next served position: feed it
        the served token there, or record the audit (maybe guarding documents) and end it."""
        token, keys = self.auditor.step(seq.request_id, logits)
        if token is not None:
            seq.token_ids.append(token)  # fed, not generated: no output, no stop checks
            return
        self.content.guarded.update(keys)
        self.scheduler.finish(seq, FinishReason.STOP)
        del self._background[seq.request_id]

    # --- leaving -----------------------------------------------------------------------------------
    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> None:
        log.error("request %s failed while %s", seq.request_id, stage, exc_info=exc)
        self._finish(seq, FinishReason.ERROR, error=f"internal error while {stage}: {type(exc).__name__}")

    def _finish_warm(self, seq: Sequence) -> None:
        open_block = self.scheduler.chunks.register_tail(seq)
        for layer in self.layers:  # the cached tail's last block will never fill: encode it now
            layer.seal(open_block)
        error = self.pins.pin(seq) if seq.pin_owner is not None else None
        if error is not None:
            self._finish(seq, FinishReason.ERROR, error=error)
        else:
            self._finish(seq, FinishReason.STOP)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.request.background:  # ended without its logits (failed, refused, aborted)
            if self._background.pop(seq.request_id, None) is not None:
                self.scheduler.finish(seq, reason, error)
                self.auditor.drop(seq.request_id)
            return
        if self._seqs.get(seq.request_id) is not seq:  # already finished
            return
        audit = self.auditor.end(seq, served=reason != FinishReason.ERROR)
        if audit is not None:
            self._add_background(audit)
        self.scheduler.finish(seq, reason, error)  # a no-op for one the scheduler finished (refused)
        self.pins.release(seq)
        seq.request.metrics.finished_time = time.monotonic()
        del self._seqs[seq.request_id]
        self._pending.append(self.outputs.final(seq))

    def _expire(self, now: float) -> None:
        timeout = self.config.request_timeout_s
        # background audits are not timed: no client waits on them, they run only while the engine is
        # idle (so under steady load they wait longer than any timeout), and at most MAX_PENDING of
        # them hold memory (engine/audit.py). Timing them dropped every audit queued more than
        # request_timeout_s before the first idle moment.
        for seq in list(self._seqs.values()):
            if now - seq.request.metrics.arrival_time > timeout:
                self._finish(seq, FinishReason.ABORT, error="timeout")

    # --- facts -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        reserved = sum(s.num_reserved_pin_blocks for s in self._seqs.values())
        assert reserved == self.store.num_reserved_pin_blocks, "pin reservations do not match the warms"

    def stats(self) -> EngineStats:
        return EngineStats.of(self)
