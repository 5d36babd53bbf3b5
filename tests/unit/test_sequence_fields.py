"""A Sequence is what a request is and where it stands (issue 34: at most 15 fields); the rest of a
request's state lives with its owners, keyed by request id (scheduler/sequence.py)."""

from __future__ import annotations

import dataclasses

from kvserve.scheduler.sequence import ReuseReport, SeqCache, Sequence


def test_a_sequence_has_at_most_15_fields():
    own = [f.name for f in dataclasses.fields(Sequence)]
    nested = [f.name for f in dataclasses.fields(SeqCache)]  # a mutable part: its fields count too
    assert len(own) - 1 + len(nested) <= 15, own + nested


def test_the_reuse_report_is_a_value():
    report = ReuseReport(num_exact_cached_tokens=128)
    assert dataclasses.is_dataclass(report) and type(report).__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert dataclasses.replace(report, plan="taken").num_exact_cached_tokens == 128
