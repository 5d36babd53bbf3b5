"""What background work may take from requests (issue 62.2): one step computes at most BACKGROUND_ROWS
rows of it for every background sequence together, so a request that arrives waits for at most one
such step however many audits are queued; and the audits requests ask for (`audit: true`) are
granted within a server-wide budget, each request told what became of its audit."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, ServeConfig
from kvserve.errors import ConfigError
from kvserve.request import Request, RequestOutput, ReuseOptions
from kvserve.reuse.audit import QUEUED, SKIPPED_NO_REUSE
from kvserve.scheduler.batch import ScheduledBatch
from kvserve.scheduler.scheduler import BACKGROUND_ROWS
from tests.integration.helpers import corpus_token_ids
from tests.integration.test_repair_in_batch import NONE, PARAMS3, make, rag_prompt, warmed

ORDERS = ([2, 0, 1], [1, 2, 0], [0, 2, 1], [2, 1, 0])
ASKED = ReuseOptions(reuse="any", recompute_strategy="none", audit=True)


def background_rows_per_step(llm: LLM) -> list[int]:
    """Spy on the scheduler: the rows of background work in each step's batch."""
    rows: list[int] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def spy(now: float) -> ScheduledBatch:
        batch = schedule(now)
        rows.append(sum(i.num_new_tokens for i in batch.items if i.seq.request.background))
        return batch

    scheduler.schedule = spy  # type: ignore[method-assign]
    return rows


def test_a_step_computes_at_most_background_rows_for_all_audits_together():
    """Four audits of 455-token prompts: the cap applied to each running background sequence and to
    the idle step's admissions, so the third idle step computed 3 x 128 rows and a request that
    arrived then waited for all of them."""
    llm = make(audit_rate=1.0)
    engine = llm.engine
    docs = warmed(llm)
    for seed, order in enumerate(ORDERS):
        (out,) = llm.generate([rag_prompt(llm, docs, order, seed=seed)], PARAMS3, reuse=NONE)
        assert out.num_approx_cached_tokens > 0
    assert len(engine.reuse.auditor.pending) == len(ORDERS)
    rows = background_rows_per_step(llm)
    for _ in range(3):
        engine.step()
    assert any(s.request.background for s in engine.scheduler.running)
    engine.add_request(Request("arrives", corpus_token_ids(llm, 20, seed=60), PARAMS3))
    engine.step()  # the next step is the request's: no background row in it
    assert rows[-1] == 0 and engine._records["arrives"].seq.num_computed_tokens > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.reuse.auditor.results) == len(ORDERS) and engine.reuse.auditor.num_dropped == 0
    assert max(rows) == BACKGROUND_ROWS, rows  # every audit's prefill ran, never more than the cap a step
    engine.check_integrity()


def _asked(llm: LLM, docs: list[list[int]], seed: int) -> RequestOutput:
    (out,) = llm.generate(
        [rag_prompt(llm, docs, ORDERS[seed % len(ORDERS)], seed=seed)], PARAMS3, reuse=ASKED
    )
    assert out.num_approx_cached_tokens > 0
    return out


def test_requested_audits_past_the_budget_are_skipped_and_the_output_says_why(monkeypatch):
    llm = make(audit_rate=0.0, audit_requests_per_minute=2)
    engine = llm.engine
    docs = warmed(llm)
    over = "skipped: over the server's budget of 2 requested audits a minute"
    assert [_asked(llm, docs, seed).audit for seed in range(3)] == [QUEUED, QUEUED, over]
    assert len(engine.reuse.auditor.pending) == 2  # the third was served without one
    (exact,) = llm.generate([corpus_token_ids(llm, 40, seed=61)], PARAMS3, reuse=ASKED)
    assert exact.num_approx_cached_tokens == 0 and exact.audit == SKIPPED_NO_REUSE
    (plain,) = llm.generate([rag_prompt(llm, docs, [1, 0, 2], seed=9)], PARAMS3, reuse=NONE)
    assert plain.audit is None  # it did not ask
    reuse = llm.stats().content_reuse
    assert reuse.num_audits_requested == 3 and reuse.num_audits_over_budget == 1
    start = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: start + 60.0)  # a minute later the budget is back
    assert _asked(llm, docs, 4).audit == QUEUED
    engine.run_background()
    assert len(engine.reuse.auditor.results) == 3
    engine.check_integrity()


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_past_the_budget_a_request_that_asks_is_sampled_like_any_other(rate: float):
    """A budget of 0 grants no requested audit; such a request still takes part in the --audit-rate
    sample (asking never makes an audit less likely)."""
    llm = make(audit_rate=rate, audit_requests_per_minute=0)
    out = _asked(llm, warmed(llm), 0)
    sampled = rate == 1.0
    assert out.audit == (
        QUEUED if sampled else "skipped: over the server's budget of 0 requested audits a minute"
    )
    assert len(llm.engine.reuse.auditor.pending) == sampled and not llm.engine.reuse.auditor.tracing
    assert llm.stats().content_reuse.num_audits_over_budget == (not sampled)


def test_a_requested_audit_dropped_for_too_many_pending_says_so(monkeypatch):
    from kvserve.reuse import audit

    monkeypatch.setattr(audit, "MAX_PENDING", 1)
    llm = make(audit_rate=0.0)
    docs = warmed(llm)
    assert [_asked(llm, docs, seed).audit for seed in range(2)] == [QUEUED, "skipped: 1 audits already wait"]
    assert len(llm.engine.reuse.auditor.pending) == 1 and llm.engine.reuse.auditor.num_dropped == 1


def test_the_budget_is_validated():
    with pytest.raises(ConfigError, match=r"audit_requests_per_minute must be 0 \(none\) or more \(got -1\)"):
        ServeConfig(audit_requests_per_minute=-1)
