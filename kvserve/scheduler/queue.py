"""Prefix-grouped admission queue.

Waiting sequences are grouped by the prefix hash of their first chunk (prompts shorter than a chunk
form groups of one). Admission order is by arrival, except that a sequence rides with its group's
oldest waiting member when it arrived at most `group_window_s` after it: requests sharing a system
prompt are admitted next to each other, and no request is ever admitted before an older one that
arrived more than `group_window_s` before it (0: FIFO). The order key of a sequence arriving at `a`
whose group's oldest member arrived at `g` is

    max(g, a - group_window_s)

so if `s` goes before an older `o` (a_o < a_s): a_s - W <= key(s) <= key(o) <= a_o, that is a_s - a_o <= W.
A popular prefix therefore cannot hold the head of the queue: its newer members queue behind everyone
who came earlier than them by more than the window. Preempted sequences keep their place by arrival.

A sequence is held back while
- it is younger than the batch window, or
- the next chunk it would compute is being computed right now by a running sequence (it will be
  cached in a step or two, and then this sequence reuses it instead of computing it again), or
- its next chunks are being loaded from a KV tier below the pool (tiers/manager.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from kvserve.scheduler.sequence import Sequence


class AdmissionQueue:
    def __init__(self, batch_window_s: float = 0.0, group_window_s: float = float("inf")):
        self.batch_window_s = batch_window_s
        self.group_window_s = group_window_s
        self._groups: dict[bytes | str, list[Sequence]] = {}  # members in arrival order
        self._order = itertools.count()  # ties in arrival time: first queued first
        self._queued_at: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._queued_at)

    def _key(self, seq: Sequence) -> bytes | str:
        return seq.cache.prefix_hashes[0] if seq.cache.prefix_hashes else seq.request_id

    def _arrival(self, seq: Sequence) -> tuple[float, int]:
        return seq.request.metrics.arrival_time, self._queued_at[seq.request_id]

    def add(self, seq: Sequence) -> None:
        """Queue `seq` at its place by arrival (a preempted sequence comes back to its old place)."""
        self._queued_at[seq.request_id] = next(self._order)
        group = self._groups.setdefault(self._key(seq), [])
        group.append(seq)
        group.sort(key=self._arrival)

    def remove(self, seq: Sequence) -> bool:
        key = self._key(seq)
        group = self._groups.get(key)
        if group is None or seq not in group:
            return False
        group.remove(seq)
        del self._queued_at[seq.request_id]
        if not group:
            del self._groups[key]
        return True

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, group by group (`candidates` gives the admission order)."""
        for group in list(self._groups.values()):
            yield from list(group)

    def _ordered(self, groups: list[list[Sequence]]) -> list[Sequence]:
        """Sequences of `groups` (each in arrival order) by the order key of the module docstring."""
        keyed = []
        for group in groups:
            oldest = group[0].request.metrics.arrival_time
            for seq in group:
                arrival, order = self._arrival(seq)
                keyed.append((max(oldest, arrival - self.group_window_s), arrival, order, seq))
        keyed.sort(key=lambda k: k[:3])
        return [k[3] for k in keyed]

    def candidates(self, now: float, is_deferred: Callable[[Sequence], bool]) -> Iterator[Sequence]:
        """Admissible sequences in admission order (the caller removes the ones it admits). A held-back
        sequence (batch window) takes no part in the order: its group's oldest ready member leads it."""
        groups = [
            ready for group in self._groups.values() if (ready := [s for s in group if self._ready(s, now)])
        ]
        for seq in self._ordered(groups):
            if not is_deferred(seq):  # asked lazily: an admission puts its chunks in flight
                yield seq

    def _ready(self, seq: Sequence, now: float) -> bool:
        return seq.report is not None or now - seq.request.metrics.arrival_time >= self.batch_window_s
