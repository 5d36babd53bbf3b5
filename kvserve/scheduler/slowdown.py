"""The decode slowdown limit: how many prefill and repair rows a step may take beside decode rows.

With `--decode-slowdown-limit L` and sequences decoding, prefill and repair slices get as many rows
as keep the step's estimated time (CostModel) within L times the decode rows' own, at least one
slice's granularity (so every prompt progresses); otherwise the whole token budget.

The bound is approximate: a few rows over a long context are bound by reading its KV, which the cost
model (fitted mostly on steps of many rows, which share that read) underprices, and the first row
pays the whole read. On the dev machine one row at position ~3,000 beside 4 short decodes already
made the step about 1.5x slower (docs/blend.md). Scaling the price of every row by the measured
ratio was tried: it drove slices to one row a step, doubled the long prompt's TTFT and did not
lower the decode ITL, so it is not done.
"""

from __future__ import annotations

from kvserve.reuse import CostModel, Repair, Work
from kvserve.scheduler.sequence import Sequence


def is_decoding(seq: Sequence, repair: Repair | None) -> bool:
    """`repair`: the content-reuse repair the sequence runs (None: none)."""
    return repair is None and seq.num_tokens - seq.num_computed_tokens == 1


class SlowdownLimit:
    def __init__(self, limit: float, cost: CostModel | None, granularity: int, budget: int):
        self.limit = limit  # 0: off
        self.cost = cost
        self.granularity = granularity
        self.budget = budget

    @property
    def active(self) -> bool:
        return self.limit > 0 and self.cost is not None

    def rows(self, decoding: list[Sequence], longest: int) -> int:
        """Rows for prefill and repair slices this step, beside `decoding`; `longest` is the longest
        sequence that may take them (its rows are priced at its end)."""
        if self.limit <= 0 or self.cost is None or not decoding:
            return self.budget
        work = Work()
        work.add_rows(sum(s.num_tokens - 1 for s in decoding), len(decoding), self.cost.num_layers)
        extra = (self.limit - 1.0) * self.cost.seconds(work)
        rows = int(extra / self.cost.row_seconds(longest))
        return max(self.granularity, min(self.budget, rows))
