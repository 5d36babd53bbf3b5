"""Prefix-grouped admission queue.

Waiting sequences are grouped by the prefix hash of their first chunk (prompts shorter than a chunk
form groups of one). Groups are served in order of their oldest member, members FIFO, so requests
sharing a system prompt are admitted next to each other. A sequence is held back while
- it is younger than the batch window, or
- the next chunk it would compute is being computed right now by a running sequence (it will be
  cached in a step or two, and then this sequence reuses it instead of computing it again), or
- its next chunks are being loaded from a KV tier below the pool (tiers/manager.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvserve.scheduler.sequence import Sequence


class AdmissionQueue:
    def __init__(self, batch_window_s: float = 0.0):
        self.batch_window_s = batch_window_s
        self._groups: OrderedDict[bytes | str, list[Sequence]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def _key(self, seq: Sequence) -> bytes | str:
        return seq.cache.prefix_hashes[0] if seq.cache.prefix_hashes else seq.request_id

    def add(self, seq: Sequence, front: bool = False) -> None:
        key = self._key(seq)
        group = self._groups.setdefault(key, [])
        if front:
            group.insert(0, seq)
            self._groups.move_to_end(key, last=False)
        else:
            group.append(seq)

    def remove(self, seq: Sequence) -> bool:
        key = self._key(seq)
        group = self._groups.get(key)
        if group is None or seq not in group:
            return False
        group.remove(seq)
        if not group:
            del self._groups[key]
        return True

    def __iter__(self) -> Iterator[Sequence]:
        for group in list(self._groups.values()):
            yield from list(group)

    def candidates(self, now: float, is_deferred: Callable[[Sequence], bool]) -> Iterator[Sequence]:
        """Admissible sequences in admission order (the caller removes the ones it admits)."""
        for seq in self:
            if seq.report is not None or now - seq.request.metrics.arrival_time >= self.batch_window_s:
                if not is_deferred(seq):
                    yield seq
