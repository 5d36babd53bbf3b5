"""ScheduledBatch: the scheduler's hand-off to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.kvcache.piece_index import PieceHit
from kvserve.scheduler.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computes token_ids[kv.num_computed_tokens : + num_new_tokens]
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    # a slice of a content-reuse repair (scheduler/repair.py): the rows' positions, and how many
    # layers they run through (None: all); else the rows are the num_new_tokens after the computed ones
    positions: list[int] | None = None
    num_layers: int | None = None
    repair: Any = None  # the Repair this slice belongs to (scheduler/repair.py), None: not a repair slice
    # query-aware repair: attention of some of these rows to measure at one layer (attention/probe.py)
    probe: Any = None
    # the sequence's blocks, one table per layer group (KVCacheManager.block_tables; -1: left a window)
    block_tables: list[list[int]] = field(default_factory=list)
    precision: str | None = None  # NestedFP: what its rows compute at this step (engine/precision.py)


@dataclass
class ContentHit:
    dst_start: int  # position of the piece in the new prompt
    hit: PieceHit
    key: bytes = b""  # the piece's content key (what the audit guard blocks)

    @property
    def num_tokens(self) -> int:
        return self.hit.piece.num_tokens

    @property
    def delta(self) -> int:
        return self.dst_start - self.hit.piece.start_pos


@dataclass
class ReusePlan:
    """A prompt prefilled with content reuse: [0, prefix_len) exact (shared blocks), the hits' KV
    copied in and moved, everything else computed, plus the repair the strategy asks for. It runs as
    a Repair (scheduler/repair.py): slices of ordinary steps."""

    seq: Sequence
    prefix_len: int
    hits: list[ContentHit]  # sorted by dst_start, non-overlapping
    strategy: str  # none, selective, cacheblend, query
    recompute_tokens: int
    sink_tokens: int
    overlap_tokens: int
    check_layer: int
    recompute_ratio: float
    seam_tokens: int = 0  # cacheblend: the first N tokens of every run always recomputed
    preset: str = ""  # where its repair came from: named by the request, the server's, or auto's preset

    def runs(self) -> list[tuple[int, int]]:
        """[start, end) ranges of reused tokens; consecutive pieces of one source in their original
        order form one run (no seam between them, nothing to repair there)."""
        runs: list[tuple[int, int]] = []
        prev: ContentHit | None = None
        for h in self.hits:
            seg = h.hit.piece
            joined = (
                prev is not None
                and prev.dst_start + prev.num_tokens == h.dst_start
                and prev.hit.piece.source_id == seg.source_id
                and prev.hit.piece.start_pos + prev.num_tokens == seg.start_pos
            )
            if joined:
                runs[-1] = (runs[-1][0], h.dst_start + h.num_tokens)
            else:
                runs.append((h.dst_start, h.dst_start + h.num_tokens))
            prev = h
        return runs


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
