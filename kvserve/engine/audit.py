"""Online audit of approximate reuse: how far the served answers are from a full prefill.

A fraction of the prompts served with content reuse (`--audit-rate`, and every request that asks with
`audit: true`) keep the logits their first token was sampled from. Each gets a background sequence:
the same prompt, exact prefix reuse only (exact reuse gives the cache-off logits, invariant 1), one
greedy token. The scheduler runs background sequences only while no request is running or waiting
(scheduler.py: `background`), so an audit never takes a step from a user's request. When its logits
come, the audit records the first-token KL(full || served) in nats and whether the top-1 tokens agree,
per repair strategy. A document (content key) whose audited KL exceeds `--audit-max-kl` is guarded:
content matching skips it from then on (ContentMatcher.guarded).

At most MAX_PENDING audits wait (their logits are a vocabulary-sized float32 row each); more are
dropped and counted.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from kvserve.request import Request, ReuseOptions, SamplingParams
from kvserve.scheduler.sequence import Sequence

MAX_PENDING = 256
HISTORY = 4096  # audited results kept per strategy for the quantiles


@dataclass
class AuditJob:
    request_id: str
    strategy: str
    served_logits: torch.Tensor  # [vocab] float32, what the first token was sampled from
    keys: list[bytes]  # content keys of the matches the served prompt reused


@dataclass
class StrategyAudit:
    kl: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    num_audited: int = 0
    num_top1_agree: int = 0


@dataclass(frozen=True)
class AuditSummary:
    num_audited: int
    top1_agreement: float
    kl_p50: float
    kl_p95: float
    kl_max: float


def first_token_kl(full: torch.Tensor, served: torch.Tensor) -> float:
    """KL(full || served) of the two next-token distributions, in nats."""
    p_log = torch.log_softmax(full.float(), dim=-1)
    q_log = torch.log_softmax(served.float(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


class Auditor:
    def __init__(self, rate: float, max_kl: float, seed: int | None):
        self.rate = rate
        self.max_kl = max_kl
        self._rng = random.Random(seed)
        self.pending: dict[str, AuditJob] = {}  # background request id -> job
        self._ids = itertools.count()
        self.by_strategy: dict[str, StrategyAudit] = {}
        self.num_dropped = 0
        self.num_guard_fired = 0  # audits whose KL put their documents under the guard
        self.results: list[
            tuple[str, str, float, bool]
        ] = []  # (request id, strategy, kl, top1): tests, benches

    def wants(self, seq: Sequence) -> bool:
        """Whether to audit this request (its prompt was served with content reuse)."""
        opts = seq.request.reuse
        asked = opts is not None and bool(opts.audit)
        return asked or (self.rate > 0 and self._rng.random() < self.rate)

    def submit(self, seq: Sequence, logits: torch.Tensor) -> Request | None:
        """The background request that recomputes `seq`'s prompt in full (None: too many wait)."""
        if len(self.pending) >= MAX_PENDING:
            self.num_dropped += 1
            return None
        # numbered: a client may reuse a request id while the audit of its first use still waits
        request_id = f"audit:{next(self._ids)}:{seq.request_id}"
        self.pending[request_id] = AuditJob(
            seq.request_id,
            seq.reuse.strategy or "",
            logits.detach().float().clone(),
            list(seq.reuse.hit_keys),
        )
        return Request(
            request_id,
            list(seq.request.prompt_token_ids),
            SamplingParams(max_tokens=1, temperature=0.0),
            cache_salt=seq.request.cache_salt,
            reuse=ReuseOptions(reuse="prefix"),
            background=True,
            weight_precision=seq.step_precision,  # what its served first token was computed at
        )

    def complete(self, request_id: str, full_logits: torch.Tensor) -> list[bytes]:
        """Record the audit; returns the content keys to guard (empty unless the KL is over the limit)."""
        job = self.pending.pop(request_id)
        kl = first_token_kl(full_logits, job.served_logits)
        agree = int(full_logits.argmax()) == int(job.served_logits.argmax())
        audit = self.by_strategy.setdefault(job.strategy, StrategyAudit())
        audit.kl.append(kl)
        audit.num_audited += 1
        audit.num_top1_agree += agree
        self.results.append((job.request_id, job.strategy, kl, agree))
        del self.results[:-HISTORY]
        if kl > self.max_kl:
            self.num_guard_fired += 1
            return job.keys
        return []

    def drop(self, request_id: str) -> None:
        """The background request ended without logits (aborted, timed out, failed)."""
        if self.pending.pop(request_id, None) is not None:
            self.num_dropped += 1

    def summary(self) -> dict[str, AuditSummary]:
        out = {}
        for strategy, a in sorted(self.by_strategy.items()):
            kl = torch.tensor(list(a.kl), dtype=torch.float64)
            p50, p95 = torch.quantile(kl, torch.tensor([0.5, 0.95], dtype=torch.float64)).tolist()
            out[strategy] = AuditSummary(
                a.num_audited, a.num_top1_agree / a.num_audited, p50, p95, float(kl.max())
            )
        return out
