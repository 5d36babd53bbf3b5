"""The step's execute: a scheduled batch through the model, one forward, or one per sequence when
the batched forward fails.

Before the forward, content reuse moves a repair's matches' KV in at its first slice and gives a
query-aware repair's slice its attention probe (ContentReuse.before_forward); the weight precision of each row is set
(engine/precision.py). A fault while moving a request's KV fails that request alone; a fault in a
batched forward is retried sequence by sequence, so only the sequence that causes it fails. Every
batched forward's wall time and work feed the cost model that content reuse plans with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from kvserve.engine.model_runner import ModelRunner, SampledRows
from kvserve.engine.precision import PrecisionPolicy
from kvserve.engine.prompt_logprobs import record
from kvserve.reuse import ContentReuse, CostModel
from kvserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from kvserve.scheduler.registration import ChunkRegistrar
from kvserve.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from kvserve.engine.requests import RequestRecord

log = logging.getLogger("kvserve.engine")


class FailHost(Protocol):
    def fail(self, seq: Sequence, stage: str, exc: Exception) -> None: ...


class StepExecute:
    def __init__(
        self,
        host: FailHost,
        runner: ModelRunner,
        reuse: ContentReuse,
        precision: PrecisionPolicy,
        chunks: ChunkRegistrar,
        cost: CostModel,
        chunk_size: int,
        records: Mapping[str, RequestRecord],
    ):
        self.host, self.runner, self.reuse, self.precision = host, runner, reuse, precision
        self.chunks, self.cost, self.chunk_size = chunks, cost, chunk_size
        self.records = records  # the engine's, of the requests and the audits' recomputes

    def run(self, items: list[ScheduledSeq]) -> list[tuple[list[ScheduledSeq], SampledRows]]:
        """The items that ran and their sampled rows (logits or greedy tokens on demand): one pair for the
        batched forward, or one per sequence that ran alone after it failed."""
        start = time.perf_counter()
        moved = 0
        for item in list(items):
            if item.repair is None or item.positions is None:
                continue
            try:
                num_moved, item.probe = self.reuse.before_forward(item.seq, item.repair, item.positions)
                moved += num_moved
            except Exception as e:
                self.host.fail(item.seq, "moving its content matches' KV", e)
                items.remove(item)
        if not items:
            return []
        self.precision.apply(items, self.records, self.chunks, self.chunk_size)
        try:
            batch = ScheduledBatch(items=items)
            inputs = self.runner.prepare_inputs(batch)
            step = self.runner.execute(batch, inputs)
        except Exception:  # find the sequence that causes it: the others must not fail with it
            log.exception("a batched forward of %d sequences failed; retrying them one by one", len(items))
            return self._one_by_one(items)
        inputs.work.moved = moved
        # the LM head runs when the update asks for tokens or logits: its time is added then
        forward_s = time.perf_counter() - start
        step.rows.on_head = lambda head_s: self.cost.observe(inputs.work, forward_s + head_s)
        record(step.prompt_logprobs)
        return [(items, step.rows)]

    def _one_by_one(self, items: list[ScheduledSeq]) -> list[tuple[list[ScheduledSeq], SampledRows]]:
        ran = []
        for item in items:
            try:
                step = self.runner.execute(ScheduledBatch(items=[item]))
            except Exception as e:
                self.host.fail(item.seq, "running the model", e)
                continue
            record(step.prompt_logprobs)
            ran.append(([item], step.rows))
        return ran
