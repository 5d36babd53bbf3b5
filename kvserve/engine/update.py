"""The step's update: what its computed rows and sampled logits do to the sequences.

Per item, in the batch's order: the scheduler's books advance (ChunkRegistrar.computed: progress,
chunks registered), a content-reuse repair moves on (CacheBlend's selection, its end), and a row
that samples gets its token: the grammar masks of the step's structured sequences in one batched
call, then the whole batch's sampling in one call (engine/batch_sampler.py: each request draws with
its own seeded generator), then per sequence grammar acceptance, audits, and the output processor's
stop checks. A fault in any of these fails that request alone (through the
engine: `StepHost.fail`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kvserve.engine.batch_sampler import Sampled, SamplingRow, sample_batch
from kvserve.engine.model_runner import SampledRows
from kvserve.engine.output import OutputProcessor
from kvserve.engine.precision import PrecisionPolicy
from kvserve.engine.sampler import plain_greedy, sample_one
from kvserve.request import FinishReason, Request
from kvserve.reuse import ContentReuse
from kvserve.scheduler.batch import ScheduledSeq
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import Sequence
from kvserve.structured import GrammarCompiler

if TYPE_CHECKING:
    from kvserve.engine.requests import RequestRecord

log = logging.getLogger(__name__)


class StepHost(Protocol):
    """What the update asks of the engine that owns the requests."""

    def fail(self, seq: Sequence, stage: str, exc: Exception) -> None: ...
    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None: ...
    def add_background(self, request: Request) -> None: ...


class StepUpdate:
    def __init__(
        self,
        host: StepHost,
        scheduler: Scheduler,
        reuse: ContentReuse,
        outputs: OutputProcessor,
        precision: PrecisionPolicy,
        grammars: GrammarCompiler,
        records: Mapping[str, RequestRecord],
    ):
        self.host, self.scheduler, self.reuse = host, scheduler, reuse
        self.records = records  # the engine's, of the requests and the audits' recomputes
        self.outputs, self.precision, self.grammars = outputs, precision, grammars
        self.logits_sink: dict[str, list[torch.Tensor]] | None = None  # tests: raw logits per request

    def apply(self, items: list[ScheduledSeq], rows: SampledRows) -> list[Sequence]:
        """rows: one sampled row per item with item.sample, in order. Where every row takes the plain
        argmax and nothing reads the logits (`_greedy_only`), only the tokens are asked for (the head's
        fused argmax where it has one); else the logits [num_sampled, vocab] (float32 or the model's
        bf16/fp16: each consumer converts the rows it reads). Sampling runs on the CPU (each request's
        seeded CPU generator, grammar masks, penalties): on a GPU the step's logits come over in one
        transfer."""
        to_sample: list[tuple[Sequence, int]] = []  # (sequence, its sampled row)
        row = 0
        for item in items:
            row += item.sample
            if item.repair is not None:
                if not self._advance_repair(item):
                    continue
            else:
                self.scheduler.chunks.computed(item)
            if item.sample:
                to_sample.append((item.seq, row - 1))
        tokens = rows.greedy_tokens() if self._greedy_only(to_sample) else None
        if tokens is not None:
            for seq, r in to_sample:
                if not seq.finished:
                    self._sample(seq, None, None, (tokens[r], None))
            return [item.seq for item in items]
        logits = rows.logits().cpu()
        masks = self._grammar_masks([seq for seq, _ in to_sample])
        sampled = self._sample_batch(logits, to_sample, masks)
        for seq, r in to_sample:
            if not seq.finished:  # a failed grammar mask fails its sequence
                self._sample(seq, logits[r], masks.get(seq.request_id), sampled.get(seq.request_id))
        return [item.seq for item in items]

    def _greedy_only(self, to_sample: list[tuple[Sequence, int]]) -> bool:
        """Whether these rows need only their argmax: each plain greedy (sampler.plain_greedy), without a
        grammar, not an audit's recompute, not served with approximate reuse (only those are audited:
        the auditor may trace their logits), and no test collects logits."""
        return self.logits_sink is None and all(
            plain_greedy(seq.request.sampling_params)
            and seq.grammar is None
            and not seq.request.background
            and (seq.report is None or seq.report.strategy is None)
            for seq, _ in to_sample
        )

    def _sample_batch(
        self, logits: torch.Tensor, to_sample: list[tuple[Sequence, int]], masks: dict[str, torch.Tensor]
    ) -> dict[str, Sampled | Exception]:
        """request id -> its token and logprob (or its draw's exception), for the rows that sample
        (not audits, not those a grammar mask failed), in one batched call. Empty if that call raised:
        each row then samples alone (`_sample`), so the fault fails only the request that caused it."""
        rows: list[SamplingRow] = []
        ids: list[str] = []
        for seq, r in to_sample:
            if seq.finished or seq.request.background:
                continue
            params = seq.request.sampling_params
            history = seq.output_token_ids if params.penalizes_history else []
            allowed = masks.get(seq.request_id)
            rows.append(SamplingRow(r, params, seq.request.prompt_token_ids, history, seq.generator, allowed))
            ids.append(seq.request_id)
        try:
            return dict(zip(ids, sample_batch(logits, rows)))
        except Exception:
            log.warning(
                "the step's batch sampler failed; its %d rows sample one by one", len(rows), exc_info=True
            )
            return {}

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
                self.host.fail(seq, "computing its grammar mask", e)
            return {}
        return {seq.request_id: allowed[i] for i, (seq, _) in enumerate(constrained)}

    def _advance_repair(self, item: ScheduledSeq) -> bool:
        """After a repair slice: its pass advances, CacheBlend's selection when its first pass ends,
        the end of the repair after its last. False if that failed (the request is failed)."""
        seq, repair = item.seq, item.repair
        assert repair is not None
        try:
            done = self.reuse.after_slice(seq, repair, item.num_new_tokens)
        except Exception as e:
            self.host.fail(seq, "repairing its reused KV", e)
            return False
        if done is not None:
            self.scheduler.chunks.repair_done(seq, done)
        return True

    def _sample(
        self,
        seq: Sequence,
        logits: torch.Tensor | None,
        allowed: torch.Tensor | None,
        sampled: Sampled | Exception | None,
    ) -> None:
        """`sampled`: its token and logprob from the step's batch sampler, or its draw's exception;
        None: sampled here alone (`sample_one`). logits: its row, None where only its greedy token was
        computed (`_greedy_only`: nothing below reads them then)."""
        if seq.request.background:
            assert logits is not None, "an audit's row keeps its logits (_greedy_only)"
            self._audit_step(seq, logits.float())
            return
        record = self.records[seq.request_id]
        stream = record.stream
        assert stream is not None, "a served request has its output"
        params = seq.request.sampling_params
        stage = "sampling"
        try:
            if isinstance(sampled, Exception):
                raise sampled
            if sampled is not None:
                token, logprob = sampled
            else:
                assert logits is not None, "a row sampled alone has its logits"
                history = seq.output_token_ids if params.penalizes_history else []
                token, logprob = sample_one(
                    logits, params, seq.request.prompt_token_ids, history, seq.generator, allowed
                )
            if seq.grammar is not None:
                stage = "following its grammar"
                seq.grammar.accept(token)
            if self.logits_sink is not None:
                assert logits is not None, "a step with a logits sink keeps its logits (_greedy_only)"
                self.logits_sink.setdefault(seq.request_id, []).append(logits.to(torch.float32, copy=True))
            if seq.request.metrics.first_token_time is None:
                metrics = seq.request.metrics
                metrics.first_token_time = time.monotonic()
                self.precision.observe_ttft(
                    metrics.first_token_time - metrics.arrival_time, metrics.first_token_time
                )
            audit = self.reuse.observe(seq, logits, token, record.last_precision, time.monotonic())
            if audit is not None:
                self.host.add_background(audit)
            stage = "processing its output"
            reason = self.outputs.append(seq, stream, token, logprob)
        except Exception as e:
            self.host.fail(seq, stage, e)
            return
        if reason is None and seq.grammar is not None and seq.grammar.ends(stream.text):
            reason = FinishReason.STOP  # the document is complete (only end-of-sequence could follow)
        if reason is not None:
            self.host.finish(seq, reason)

    def _audit_step(self, seq: Sequence, logits: torch.Tensor) -> None:
        """An audit's recompute has the full prefill's logits at the next served position: feed it
        the served token there, or record the audit (maybe guarding documents) and end it."""
        token = self.reuse.audit_step(seq, logits)
        if token is not None:
            seq.token_ids.append(token)  # fed, not generated: no output, no stop checks
            return
        self.host.finish(seq, FinishReason.STOP)  # the auditor recorded it
