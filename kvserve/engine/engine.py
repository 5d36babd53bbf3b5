"""Engine: step() = schedule -> execute -> update, plus request intake, aborts and stats.

Not thread-safe: one thread drives it (LLM directly, AsyncEngine through its worker thread).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from kvserve.config import ServeConfig
from kvserve.engine.blend_runner import BlendRunner
from kvserve.engine.builder import build_parts, check_content_reuse
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output import OutputBuilder
from kvserve.engine.sampler import sample_one
from kvserve.engine.stats import engine_stats
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.chunk_store import ChunkStore
from kvserve.kvcache.hashing import prompt_chunk_hashes, root_hash
from kvserve.kvcache.segment_index import SegmentIndex
from kvserve.request import FinishReason, Request, RequestOutput, TokenLogprob
from kvserve.scheduler.batch import BlendPlan, ScheduledBatch
from kvserve.scheduler.content import ContentMatcher
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import Sequence
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
        self.store = ChunkStore(self.pool, config.chunk_size, config.eviction_policy)
        device = torch.device(self.info.device)
        rotator, reason = check_content_reuse(self.model)
        self.content = ContentMatcher(config, SegmentIndex(self.store), rotator is not None, reason)
        self.blend_runner = BlendRunner(self.model, self.layers, rotator, device) if rotator else None
        if config.reuse == "any" and rotator is None:
            log.warning("approximate reuse disabled: %s", reason)
        self.scheduler = Scheduler(
            self.pool,
            self.store,
            self.info.namespace,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.batch_window_ms / 1000.0,
            config.enable_prefix_caching,
            self.content,
        )
        self.runner = ModelRunner(self.model, self.layers, parts.backend, device)
        self.outputs = OutputBuilder()
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.check_integrity_each_step = False  # tests: verify pool ownership after every step
        self.logits_sink: dict[str, list[torch.Tensor]] | None = None  # tests: raw logits per request

    # --- intake ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue. Raises InvalidRequestError (the engine state is unchanged then)."""
        self._validate(request)
        if request.warm_only and self.scheduler.content is None:  # only whole chunks can be prefix-matched
            usable = len(request.prompt_token_ids) // self.config.chunk_size * self.config.chunk_size
            request.prompt_token_ids = request.prompt_token_ids[:usable]
        params = request.sampling_params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request=request,
            generator=torch.Generator().manual_seed(seed),
            detokenizer=None
            if request.warm_only
            else IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            root_hash=root_hash(self.info.namespace, request.cache_salt),
        )
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)
        if request.warm_only and not request.prompt_token_ids:
            self._finish(seq, FinishReason.STOP)

    def _validate(self, request: Request) -> None:
        n = len(request.prompt_token_ids)
        limit = self.info.max_model_len
        if request.request_id in self._seqs:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
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
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.tokenizer.vocab_size - 1})",
                param="prompt",
            )
        need_tokens = min(n + request.sampling_params.max_tokens, limit)
        if -(-need_tokens // self.config.block_size) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need_tokens} tokens of KV but the pool holds {self.info.pool_tokens}; "
                "raise max_cache_bytes or lower max_tokens",
                param="max_tokens",
            )

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, FinishReason.ABORT, error=reason)
        return True

    def unpin(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Unpin the cached chunks of this prompt prefix; returns how many were pinned."""
        root = root_hash(self.info.namespace, cache_salt)
        hashes = prompt_chunk_hashes(token_ids, self.config.chunk_size, root)
        return sum(self.store.set_pinned(h, False) for h in hashes)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        self._expire(now)
        batch = self.scheduler.schedule(now)
        touched: list[Sequence] = []
        if batch:
            touched = self._execute_and_update(batch)
        for seq in list(self.scheduler.running):
            if seq.request.warm_only and seq.num_computed_tokens >= seq.num_tokens:
                self._finish_warm(seq)
                touched.append(seq)
        self.num_steps += 1
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        outputs, self._pending = self._pending, []
        seen: set[str] = set()
        for seq in touched:
            if seq.request_id in seen or seq.finished:  # finished ones were queued in _pending
                continue
            seen.add(seq.request_id)
            out = self.outputs.delta(seq, self._holdback(seq))
            if out is not None:
                outputs.append(out)
        return outputs

    def _execute_and_update(self, batch: ScheduledBatch) -> list[Sequence]:
        touched = []
        if batch.items:
            touched += self._execute_items(batch)
        for plan in batch.blends:
            touched += self._execute_blend(plan)
        return touched

    def _execute_items(self, batch: ScheduledBatch) -> list[Sequence]:
        try:
            logits = self.runner.execute(batch)
        except Exception as e:  # a failing step must not take the engine down (invariant 5)
            log.exception("step failed; finishing its %d requests with an error", len(batch.items))
            for item in batch.items:
                self._finish(item.seq, FinishReason.ERROR, error=f"internal error: {type(e).__name__}")
            return []
        row = 0
        touched = []
        for item in batch.items:
            seq = item.seq
            start = seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(
                0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start
            )
            self.scheduler.on_computed(item)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.monotonic()
            if item.sample:
                self._sample(seq, logits[row])
                row += 1
            touched.append(seq)
        return touched

    def _execute_blend(self, plan: BlendPlan) -> list[Sequence]:
        seq = plan.seq
        assert self.blend_runner is not None
        try:
            logits, report = self.blend_runner.execute(plan)
        except Exception as e:
            log.exception("content-reuse prefill failed")
            self._finish(seq, FinishReason.ERROR, error=f"internal error: {type(e).__name__}")
            return []
        self.scheduler.blend_done(plan)
        self.num_prompt_tokens_computed += seq.num_prompt_tokens - plan.prefix_len - report.num_reused_tokens
        seq.num_approx_cached_tokens = report.num_reused_tokens - report.num_recomputed_tokens
        seq.num_recomputed_tokens = report.num_recomputed_tokens
        seq.compute_fraction = report.compute_fraction
        self.content.num_hit_tokens += report.num_reused_tokens
        self.content.num_recomputed_tokens += report.num_recomputed_tokens
        if seq.request.metrics.first_scheduled_time is None:
            seq.request.metrics.first_scheduled_time = time.monotonic()
        self._sample(seq, logits)
        return [seq]

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.request.sampling_params
        token, logprob = sample_one(
            logits, params, seq.request.prompt_token_ids, seq.output_token_ids, seq.generator
        )
        if self.logits_sink is not None:
            self.logits_sink.setdefault(seq.request_id, []).append(logits.clone())
        self._append_token(seq, token, logprob)

    # --- update helpers ----------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        params = seq.request.sampling_params
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.monotonic()
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        if token in params.stop_token_ids:
            return self._finish(seq, FinishReason.STOP, stop_reason=token)
        if not params.ignore_eos and token in self.info.eos_token_ids:
            return self._finish(seq, FinishReason.STOP)
        assert seq.detokenizer is not None
        delta = seq.detokenizer.add(token)
        seq.text += delta
        if params.stop and delta:
            if self._check_stop_strings(seq, len(delta)):
                return None
        num_output = len(seq.output_token_ids)
        if num_output >= params.max_tokens or seq.num_tokens >= self.info.max_model_len:
            return self._finish(seq, FinishReason.LENGTH)
        return None

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        params = seq.request.sampling_params
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in params.stop:
            idx = seq.text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        seq.text = seq.text[: idx + len(s)] if params.include_stop_str_in_output else seq.text[:idx]
        self._finish(seq, FinishReason.STOP, stop_reason=s)
        return True

    def _holdback(self, seq: Sequence) -> int:
        """Characters not yet safe to stream: they could be the start of a stop string."""
        stop = seq.request.sampling_params.stop
        return max((len(s) for s in stop), default=1) - 1 if stop else 0

    def _finish_warm(self, seq: Sequence) -> None:
        self.scheduler.register_tail(seq)
        if seq.request.pin:
            self.scheduler.pin_prefix(seq, True)
        self._finish(seq, FinishReason.STOP)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        if seq.finished:
            return
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, reason, error)
        seq.request.metrics.finished_time = time.monotonic()
        self._seqs.pop(seq.request_id, None)
        self._pending.append(self.outputs.final(seq))

    def _expire(self, now: float) -> None:
        timeout = self.config.request_timeout_s
        for seq in list(self._seqs.values()):
            if now - seq.request.metrics.arrival_time > timeout:
                self._finish(seq, FinishReason.ABORT, error="timeout")

    # --- facts -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)
