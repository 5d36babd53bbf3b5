"""ContentReuse: the one interface between content (approximate) reuse and the rest of the engine.

In the spirit of vLLM v1's KV connector, the scheduler and the step talk to content reuse through
this object alone; what lies behind it (the piece matcher and its cost-aware choice, repair plans,
moving KV in, probes, audits, the verified presets) is this package's own.

Scheduler side:
  prepare / forget       a request's prompt pieces, cut when it is queued, dropped when it ends
  consider               what a waiting request can take from content matches, and at what cost
  start                  it was admitted: record the choice, and begin the repair it runs (if any)
  repair / drop          the repair in progress: the scheduler cuts its rows into slices
                         (ScheduledSeq.repair); a preempted one is dropped (planned again at
                         re-admission)
  register               index the pieces of a sequence's newly cached chunks
Step side:
  before_forward         a repair's first slice moves its matches' KV in; a query-aware slice gets
                         the attention probe the model runner measures (ScheduledSeq.probe)
  after_slice            a computed slice advances its pass; CacheBlend's or query-aware selection
                         when a first pass ends; the end of a repair after its last pass (its
                         counts added to the stats, what it leaves the scheduler's books to do)
  audits                 the online audit (Auditor): sampled, recomputed, compared
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.reuse.audit import Auditor, AuditStats
from kvserve.reuse.matcher import Choice, ContentMatcher, MatcherStats
from kvserve.reuse.repair import Repair, Repairs, make_repair
from kvserve.reuse.repairer import Repairer

if TYPE_CHECKING:
    import torch

    from kvserve.request import Request
    from kvserve.reuse.probe import AttentionProbe
    from kvserve.scheduler.sequence import Sequence


@dataclass(frozen=True)
class RepairDone:
    """A repair's last pass is in: the prompt's KV is complete."""

    sources: set[bytes]  # the prefix hashes of its hits' source chunks: the sequence releases them
    num_fresh_tokens: int  # the prompt tokens it computed fresh (not reused)


@dataclass(frozen=True)
class ContentReuseStats(MatcherStats, AuditStats):
    """The content matcher's counters and the auditor's, side by side (/v1/stats `cache.reuse`)."""

    @classmethod
    def of(cls, matcher: MatcherStats, audits: AuditStats) -> ContentReuseStats:
        return cls(**{f.name: getattr(v, f.name) for v in (matcher, audits) for f in dataclasses.fields(v)})


class ContentReuse:
    def __init__(self, matcher: ContentMatcher, repairer: Repairer | None, auditor: Auditor):
        self.matcher, self.repairer, self.auditor = matcher, repairer, auditor
        self.repairs = Repairs()

    # --- what is available ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """The model's RoPE re-rotates and the start-up self-check passed."""
        return self.matcher.enabled

    @property
    def disabled_reason(self) -> str:
        return self.matcher.disabled_reason

    # --- scheduler side ------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        self.matcher.prepare(seq)

    def forget(self, request_id: str) -> None:
        self.matcher.forget(request_id)

    def consider(self, seq: Sequence, num_cached_tokens: int) -> Choice | None:
        """What to do with the prompt's content matches after its exact prefix (None: it has none or
        looks for none). No side effects: admission may consider a sequence several times."""
        if not self.matcher.wants(seq):
            return None
        return self.matcher.consider(seq, num_cached_tokens)

    def start(self, seq: Sequence, choice: Choice | None) -> Repair | None:
        """The sequence was admitted with `choice`: record it, and begin the repair a taken plan runs."""
        if choice is None:
            return None
        self.matcher.record(seq, choice)
        if choice.plan is None:
            return None
        repair = make_repair(choice.plan, seq.num_prompt_tokens, self.matcher.cost.num_layers)
        return self.repairs.start(seq.request_id, repair)

    def repair(self, request_id: str) -> Repair | None:
        return self.repairs.get(request_id)

    def drop(self, request_id: str) -> None:
        """The sequence left the pool (preempted or finished): its repair, if any, is dropped."""
        self.repairs.drop(request_id)

    def register(self, seq: Sequence, num_held_tokens: int, chunk_hashes: list[bytes]) -> None:
        self.matcher.register(seq, num_held_tokens, chunk_hashes)

    # --- step side -----------------------------------------------------------------------------------
    def before_forward(
        self, seq: Sequence, repair: Repair, positions: list[int]
    ) -> tuple[int, AttentionProbe | None]:
        """A repair slice (its rows at `positions`) is about to run: at its first, move the matches'
        KV in. Returns the token-layers moved, and for a query-aware first pass the attention probe of
        the slice's question rows (the model runner measures it)."""
        assert self.repairer is not None, "a repair runs only where the repairer exists"
        moved = 0 if repair.moved else self.repairer.begin(seq, repair)
        return moved, self.repairer.probe(seq, repair, positions)

    def after_slice(self, seq: Sequence, repair: Repair, num_rows: int) -> RepairDone | None:
        """A slice of `num_rows` rows of the repair's current pass was computed: select the second
        pass when the first ends; after the last, end the repair (its counts added to the stats) and
        say what the scheduler's books do with it (None: not finished)."""
        assert self.repairer is not None
        repair.computed(num_rows)
        if repair.awaits_selection:
            self.repairer.select(seq, repair)
        if not repair.finished:
            return None
        report = self.repairer.finish(seq, repair)
        self.matcher.num_hit_tokens += report.num_reused_tokens
        self.matcher.num_recomputed_tokens += report.num_recomputed_tokens
        self.repairs.end(seq.request_id)
        sources = {c.prefix_hash for hit in repair.plan.hits for c in hit.hit.chunks}
        return RepairDone(sources, len(repair.fresh))

    def audit_step(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """An audit's recompute has the full prefill's logits at the next served position: the served
        token to feed there, or None when the audit is complete (recorded; maybe guarding documents,
        and `auto`'s watch told its agreement)."""
        token, keys = self.auditor.step(seq.request_id, logits)
        if token is not None:
            return token
        self.matcher.guarded.update(keys)
        result = self.auditor.results[-1]  # the one just completed
        if result.auto:
            self.matcher.auto.observe(result.agreement)
        return None

    # --- audits --------------------------------------------------------------------------------------
    def observe(
        self, seq: Sequence, logits: torch.Tensor | None, token: int, weight_precision: str | None, now: float
    ) -> Request | None:
        """A served token: an audit may start at the first (sampled or asked for), records the served
        tokens and, at its last, returns the full recompute to run in the background."""
        if seq.num_output_tokens == 0 and self.auditor.wants(seq, now):
            self.auditor.start(seq)
        return self.auditor.observe(seq, logits, token, weight_precision)

    def finished(self, seq: Sequence, served: bool, weight_precision: str | None) -> Request | None:
        """A served request ended: the full recompute of its audit, if one traced it and it was served."""
        return self.auditor.end(seq, served, weight_precision)

    def background_done(self, request_id: str) -> None:
        """An audit's recompute left the engine (done, failed or aborted)."""
        self.auditor.drop(request_id)

    def reset(self) -> None:
        """Forget every request (the engine starts over after a failed step)."""
        for rid in self.matcher.request_ids():
            self.matcher.forget(rid)
        for rid in [*self.auditor.tracing, *self.auditor.pending]:
            self.auditor.forget(rid)
        for rid in self.repairs.request_ids():
            self.repairs.drop(rid)

    # --- books -----------------------------------------------------------------------------------------
    def request_ids(self) -> dict[str, set[str]]:
        """Its tables kept by request id: prompt pieces (prepared, not forgotten), repairs in progress,
        audit traces (served requests) and audit jobs (their background recomputes)."""
        return {
            "content pieces": self.matcher.request_ids(),
            "repairs": self.repairs.request_ids(),
            "audit traces": set(self.auditor.tracing),
            "audit jobs": set(self.auditor.pending),
        }

    def check_integrity(self) -> None:
        self.matcher.index.check_integrity()

    def stats(self) -> ContentReuseStats:
        return ContentReuseStats.of(self.matcher.stats(), self.auditor.stats())
