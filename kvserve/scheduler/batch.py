"""ScheduledBatch: the scheduler's hand-off to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.reuse import AttentionProbe, Repair
from kvserve.scheduler.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computes token_ids[kv.num_computed_tokens : + num_new_tokens]
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    # rows at explicit positions, through the first num_layers layers (None: all): a slice of a
    # content-reuse repair; else the rows are the num_new_tokens after the computed ones, every layer
    positions: list[int] | None = None
    num_layers: int | None = None
    repair: Repair | None = None  # the content-reuse repair this slice belongs to (kvserve/reuse/)
    # attention of some of these rows to measure at one layer (query-aware repair: ContentReuse.before_forward)
    probe: AttentionProbe | None = None
    # the sequence's blocks, one table per layer group (KVCacheManager.block_tables; -1: left a window)
    block_tables: list[list[int]] = field(default_factory=list)
    precision: str | None = None  # NestedFP: what its rows compute at this step (engine/precision.py)


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # sequences that can never get their blocks (pinned memory leaves too little): the engine fails
    # them with the reason instead of letting them wait forever
    refused: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items) or bool(self.refused)
