"""Online audit of approximate reuse: how far the served answers are from a full prefill.

A fraction of the prompts served with content reuse (`--audit-rate`, and the requests that ask with
`audit: true`, within a budget) keep the logits each of their first K tokens was sampled from
(`--audit-tokens`, 16), and the tokens. When the request has K tokens, or ends with fewer, it gets a background sequence: the
same prompt, exact prefix reuse only (exact reuse gives the cache-off logits, invariant 1), fed the
served tokens one by one (teacher forcing) instead of sampling. The scheduler runs background
sequences only while no request is running or waiting (scheduler.py: `background`), so an audit never
takes a step from a user's request. Each of its steps gives the full prefill's distribution at one
served position; the audit records, per repair strategy:
  first-token KL   KL(full || served) of the first token, in nats, and whether the top-1 tokens agree
  mean KL          the KL averaged along the served tokens
  agreement        the share of the served tokens that are the full prefill's greedy choice there
A document (content key) whose audited mean KL exceeds `--audit-max-kl` is guarded: content matching
skips it from then on (ContentMatcher.guarded).

Any client can ask for an audit, so what requests ask is budgeted for the whole server: at most
`--audit-requests-per-minute` requests asking with `audit: true` are granted one in any 60 s; past it
a request that asks is sampled at `--audit-rate` like any other. A request that asked is told what
became of it (`Sequence.audit`, `usage.kvserve.audit`): "queued", or "skipped: <why>". Sampled audits
are the server's own and not counted. At most MAX_PENDING audits wait, each holding up to K
vocabulary-sized float32 rows (K = 16 and a 49,152-token vocabulary: 3 MB); more are dropped and
counted. A waiting audit has no timeout (no client waits on it): under steady load it waits for the
first idle moment however long that takes. The scheduler gives all background sequences together at
most BACKGROUND_ROWS rows a step (scheduler.py), so a request that arrives waits for at most one such
step however many audits are queued.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvserve.request import Request, ReuseOptions, SamplingParams
from kvserve.reuse.verified import AUTO_SOURCE

if TYPE_CHECKING:
    from kvserve.scheduler.sequence import Sequence

MAX_PENDING = 64
HISTORY = 4096  # audited results kept per strategy for the quantiles
BUDGET_WINDOW_S = 60.0  # the requested-audit budget counts the audits granted in this window

# what became of the audit a request asked for (usage.kvserve.audit)
QUEUED = "queued"
SKIPPED_NO_REUSE = "skipped: no approximate reuse to audit"


@dataclass
class Trace:
    """What a served request's first tokens were sampled from."""

    strategy: str
    keys: list[bytes]  # content keys of the matches the served prompt reused
    auto: bool  # repaired with auto's verified preset (the AutoWatch judges those)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32 per served token
    tokens: list[int] = field(default_factory=list)


@dataclass
class AuditJob:
    request_id: str  # the served request's
    trace: Trace
    kls: list[float] = field(default_factory=list)  # per served position computed so far
    agree: list[bool] = field(default_factory=list)  # full prefill's greedy token == the served one
    top1: bool = False  # the first position's argmax of both distributions agree


class AuditResult(NamedTuple):
    request_id: str
    strategy: str
    first_kl: float
    top1: bool
    mean_kl: float  # along the served tokens
    agreement: float  # share of served tokens equal to the full prefill's greedy choice
    num_tokens: int
    auto: bool  # the served prompt was repaired with auto's verified preset


@dataclass
class StrategyAudit:
    kl: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))  # first-token
    mean_kl: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    num_audited: int = 0
    num_top1_agree: int = 0
    num_tokens: int = 0
    num_tokens_agree: int = 0


@dataclass(frozen=True)
class AuditSummary:
    num_audited: int
    top1_agreement: float
    kl_p50: float
    kl_p95: float
    kl_max: float
    greedy_agreement: float  # over the audited tokens (up to --audit-tokens per request)
    mean_kl_p50: float  # the KL averaged along each request's audited tokens: quantiles over requests
    mean_kl_p95: float
    mean_kl_max: float


@dataclass(frozen=True)
class AuditStats:
    audit: dict[str, AuditSummary]  # per repair strategy: mean and first-token KL quantiles, agreement
    num_audits_pending: int
    num_audits_dropped: int  # not run: too many waited, or the recompute ended without logits
    num_audits_requested: int  # requests served with approximate reuse that asked for one (audit: true)
    num_audits_over_budget: int  # of those, served without one: past --audit-requests-per-minute, not sampled
    num_guard_fired: int  # audits whose mean KL is over --audit-max-kl (documents no longer matched)


def first_token_kl(full: torch.Tensor, served: torch.Tensor) -> float:
    """KL(full || served) of the two next-token distributions, in nats."""
    p_log = torch.log_softmax(full.float(), dim=-1)
    q_log = torch.log_softmax(served.float(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


def _quantiles(values: deque[float]) -> tuple[float, float, float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    p50, p95 = torch.quantile(t, torch.tensor([0.5, 0.95], dtype=torch.float64)).tolist()
    return p50, p95, float(t.max())


class Auditor:
    def __init__(
        self,
        rate: float,
        max_kl: float,
        seed: int | None,
        num_tokens: int = 16,
        requests_per_minute: int = 30,
    ):
        self.rate = rate
        self.max_kl = max_kl
        self.num_tokens = num_tokens
        self.requests_per_minute = requests_per_minute  # audits granted to `audit: true` per window
        self._granted: deque[float] = deque()  # when each requested audit of the window was granted
        self.num_requested = 0  # requests that asked for an audit and were served with content reuse
        self.num_over_budget = 0  # of those, served without one: past the budget and not sampled
        self._rng = random.Random(seed)
        self.tracing: dict[str, Trace] = {}  # served request id -> its trace, until submitted
        self.pending: dict[str, AuditJob] = {}  # background request id -> job
        self._ids = itertools.count()
        self.by_strategy: dict[str, StrategyAudit] = {}
        self.num_dropped = 0
        self.num_guard_fired = 0  # audits whose KL put their documents under the guard
        self.results: list[AuditResult] = []  # the latest HISTORY audits: tests, benches

    def wants(self, seq: Sequence, now: float) -> bool:
        """Whether to audit this request, at its first token: one served with approximate reuse that
        asks (`audit: true`) while the budget lasts, else the `rate` sample (past the budget, one that
        asked is sampled as if it had not). A request that asked gets the outcome in `seq.audit`."""
        opts = seq.request.reuse
        asked = opts is not None and bool(opts.audit)
        if seq.report is None or seq.report.strategy is None:  # served exactly: nothing to measure
            if asked:
                seq.audit = SKIPPED_NO_REUSE
            return False
        if asked:
            self.num_requested += 1
            if self._grant(now):
                seq.audit = QUEUED
                return True
        sampled = self.rate > 0 and self._rng.random() < self.rate
        if asked and not sampled:
            self.num_over_budget += 1
            seq.audit = (
                f"skipped: over the server's budget of {self.requests_per_minute} requested audits a minute"
            )
        elif asked:
            seq.audit = QUEUED
        return sampled

    def _grant(self, now: float) -> bool:
        """Count one requested audit against the budget of the last BUDGET_WINDOW_S (False: spent)."""
        while self._granted and now - self._granted[0] >= BUDGET_WINDOW_S:
            self._granted.popleft()
        if len(self._granted) >= self.requests_per_minute:
            return False
        self._granted.append(now)
        return True

    def start(self, seq: Sequence) -> None:
        """Trace `seq` from its first token on."""
        assert seq.report is not None  # it was served
        report = seq.report
        auto = (report.preset or "").startswith(AUTO_SOURCE)
        self.tracing[seq.request_id] = Trace(report.strategy or "", list(report.hit_keys), auto)

    def observe(
        self, seq: Sequence, logits: torch.Tensor | None, token: int, weight_precision: str | None
    ) -> Request | None:
        """A traced request sampled `token` from `logits` (computed at `weight_precision`); at its
        K-th token, the audit's request. `logits` is None only for a request not traced (a greedy step
        that computed tokens only: StepUpdate._greedy_only)."""
        trace = self.tracing.get(seq.request_id)
        if trace is None:
            return None
        assert logits is not None, "a traced request's step keeps its logits"
        trace.logits.append(logits.detach().float().clone())
        trace.tokens.append(token)
        return self._submit(seq, weight_precision) if len(trace.tokens) >= self.num_tokens else None

    def end(self, seq: Sequence, served: bool, weight_precision: str | None) -> Request | None:
        """A traced request finished: the audit of what it served (None: nothing to audit, or it
        failed: `served` False)."""
        trace = self.tracing.get(seq.request_id)
        if trace is None:
            return None
        if not served or not trace.tokens:
            del self.tracing[seq.request_id]
            return None
        return self._submit(seq, weight_precision)

    def _submit(self, seq: Sequence, weight_precision: str | None) -> Request | None:
        """The background request that recomputes `seq`'s prompt in full and is fed its served
        tokens (None: too many wait)."""
        trace = self.tracing.pop(seq.request_id)
        if len(self.pending) >= MAX_PENDING:
            self.num_dropped += 1
            if seq.audit is not None:  # it asked
                seq.audit = f"skipped: {MAX_PENDING} audits already wait"
            return None
        # numbered: a client may reuse a request id while the audit of its first use still waits
        request_id = f"audit:{next(self._ids)}:{seq.request_id}"
        self.pending[request_id] = AuditJob(seq.request_id, trace)
        return Request(
            request_id,
            list(seq.request.prompt_token_ids),
            SamplingParams(max_tokens=len(trace.tokens), temperature=0.0, ignore_eos=True),
            cache_salt=seq.request.cache_salt,
            reuse=ReuseOptions(reuse="prefix"),
            background=True,
            weight_precision=weight_precision,  # what its served tokens were computed at
        )

    def step(self, request_id: str, full_logits: torch.Tensor) -> tuple[int | None, list[bytes]]:
        """The audit's recompute has the full prefill's logits at the next served position. Returns
        (the served token to feed next, or None when the audit is complete; the content keys to guard,
        empty unless the audit completed with its mean KL over the limit)."""
        job = self.pending[request_id]
        j = len(job.kls)
        trace = job.trace
        job.kls.append(first_token_kl(full_logits, trace.logits[j]))
        job.agree.append(int(full_logits.argmax()) == trace.tokens[j])
        if j == 0:
            job.top1 = int(full_logits.argmax()) == int(trace.logits[0].argmax())
        if j + 1 < len(trace.tokens):
            return trace.tokens[j], []
        return None, self._complete(request_id)

    def _complete(self, request_id: str) -> list[bytes]:
        job = self.pending.pop(request_id)
        trace = job.trace
        first_kl = job.kls[0]
        mean_kl = sum(job.kls) / len(job.kls)
        result = AuditResult(
            job.request_id,
            trace.strategy,
            first_kl,
            job.top1,
            mean_kl,
            sum(job.agree) / len(job.agree),
            len(job.kls),
            trace.auto,
        )
        audit = self.by_strategy.setdefault(trace.strategy, StrategyAudit())
        audit.kl.append(first_kl)
        audit.mean_kl.append(mean_kl)
        audit.num_audited += 1
        audit.num_top1_agree += result.top1
        audit.num_tokens += result.num_tokens
        audit.num_tokens_agree += sum(job.agree)
        self.results.append(result)
        del self.results[:-HISTORY]
        if mean_kl > self.max_kl:
            self.num_guard_fired += 1
            return trace.keys
        return []

    def drop(self, request_id: str) -> None:
        """The background request ended before its last step (aborted, timed out, failed)."""
        if self.pending.pop(request_id, None) is not None:
            self.num_dropped += 1

    def forget(self, request_id: str) -> None:
        """The request is gone without ending here (the engine's rebuild): its trace, or its audit
        (counted as dropped)."""
        self.tracing.pop(request_id, None)
        self.drop(request_id)

    def summary(self) -> dict[str, AuditSummary]:
        out = {}
        for strategy, a in sorted(self.by_strategy.items()):
            out[strategy] = AuditSummary(
                a.num_audited,
                a.num_top1_agree / a.num_audited,
                *_quantiles(a.kl),
                a.num_tokens_agree / a.num_tokens,
                *_quantiles(a.mean_kl),
            )
        return out

    def stats(self) -> AuditStats:
        return AuditStats(
            audit=self.summary(),
            num_audits_pending=len(self.pending),
            num_audits_dropped=self.num_dropped,
            num_audits_requested=self.num_requested,
            num_audits_over_budget=self.num_over_budget,
            num_guard_fired=self.num_guard_fired,
        )
