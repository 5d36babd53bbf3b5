"""ScheduledBatch: the scheduler's hand-off to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.scheduler.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computes token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
    sample: bool  # this step reaches the end of the known tokens: sample the next one


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
