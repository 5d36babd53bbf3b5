"""A content-reuse plan: the exact prefix, the content hits whose KV is moved in, and the repair its
strategy asks for (repair.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kvcache.piece_index import PieceHit

if TYPE_CHECKING:
    from kvserve.scheduler.sequence import Sequence


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
    a Repair (reuse/repair.py): slices of ordinary steps."""

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
