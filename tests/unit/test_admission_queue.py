"""AdmissionQueue: requests sharing a prefix are admitted together, but never ahead of a request that
arrived more than the group window before them; preempted sequences keep their place by arrival."""

from __future__ import annotations

import itertools

import torch

from kvserve.request import Request, RequestMetrics
from kvserve.scheduler.queue import AdmissionQueue
from kvserve.scheduler.sequence import SeqCache, Sequence

_ids = itertools.count()


def seq(prefix: str, arrival: float) -> Sequence:
    request = Request(f"{prefix}-{next(_ids)}", [1, 2, 3], metrics=RequestMetrics(arrival_time=arrival))
    return Sequence(request, torch.Generator(), SeqCache(b"root", [prefix.encode()]))


def order(queue: AdmissionQueue, now: float = 1e9) -> list[str]:
    return [s.request_id for s in queue.candidates(now, lambda s: False)]


def test_a_stream_of_one_prefix_does_not_hold_the_head_of_the_queue() -> None:
    """The starvation of issue 62: a hot prefix whose group never empties. The minority request must
    go before every hot request that arrived more than the window after it."""
    queue = AdmissionQueue(group_window_s=1.0)
    for t in range(5):  # hot requests at 0..4 s
        queue.add(seq("hot", float(t)))
    minority = seq("cold", 4.5)
    queue.add(minority)
    for t in range(5, 60):  # the hot stream goes on
        queue.add(seq("hot", float(t)))
    ids = order(queue)
    # ahead of it: the hot requests older than it, and the ones at most 1 s younger (4.5 < t <= 5.5)
    assert ids.index(minority.request_id) == 6
    assert all(i.startswith("hot") for i in ids[:6])


def test_requests_within_the_window_ride_with_their_groups_oldest_member() -> None:
    queue = AdmissionQueue(group_window_s=1.0)
    a0, b0, a1, b1, a2 = seq("a", 0.0), seq("b", 0.1), seq("a", 0.5), seq("b", 0.6), seq("a", 3.0)
    for s in (a0, b0, a1, b1, a2):
        queue.add(s)
    assert order(queue) == [a0.request_id, a1.request_id, b0.request_id, b1.request_id, a2.request_id]


def test_no_request_goes_before_one_older_than_it_by_more_than_the_window() -> None:
    """The invariant, over a random mix of prefixes and arrivals."""
    rng = torch.Generator().manual_seed(0)
    for window in (0.0, 0.5, 2.0):
        queue = AdmissionQueue(group_window_s=window)
        arrivals = (torch.rand(80, generator=rng) * 20).tolist()
        prefixes = torch.randint(0, 4, (80,), generator=rng).tolist()
        seqs = [seq(f"p{p}", a) for p, a in zip(prefixes, arrivals, strict=True)]
        for s in seqs:
            queue.add(s)
        admitted = list(queue.candidates(1e9, lambda s: False))
        assert len(admitted) == len(seqs)
        for i, first in enumerate(admitted):  # everything after it is never older by more than the window
            for after in admitted[i + 1 :]:
                assert (
                    first.request.metrics.arrival_time - after.request.metrics.arrival_time <= window + 1e-9
                )


def test_zero_window_is_first_come_first_served() -> None:
    queue = AdmissionQueue(group_window_s=0.0)
    seqs = [seq(p, t) for t, p in enumerate("abacabca")]
    for s in reversed(seqs):
        queue.add(s)
    assert order(queue) == [s.request_id for s in seqs]


def test_a_preempted_sequence_comes_back_at_its_place_by_arrival() -> None:
    queue = AdmissionQueue(group_window_s=0.0)
    first, second, third = seq("a", 0.0), seq("b", 1.0), seq("b", 2.0)
    for s in (first, second, third):
        queue.add(s)
    assert queue.remove(second)  # admitted ...
    queue.add(second)  # ... and preempted: back before the younger one of its group, not at the front
    assert order(queue) == [first.request_id, second.request_id, third.request_id]
    assert len(queue) == 3


def test_held_back_sequences_are_skipped_and_deferral_is_asked_in_order() -> None:
    queue = AdmissionQueue(batch_window_s=1.0, group_window_s=10.0)
    old, young = seq("a", 0.0), seq("b", 9.5)
    queue.add(old)
    queue.add(young)
    assert order(queue, now=10.0) == [old.request_id]  # young is within the batch window
    asked: list[str] = []

    def deferred(s: Sequence) -> bool:
        asked.append(s.request_id)
        return s is old

    assert [s.request_id for s in queue.candidates(20.0, deferred)] == [young.request_id]
    assert asked == [old.request_id, young.request_id]
