"""Repair: a prompt prefilled with content reuse, as passes of rows at explicit positions.

Position map of the prompt [0, n) under a ReusePlan:
  [0, prefix_len)   exact prefix: shared blocks, never touched
  reused            the hits' KV, copied in and re-rotated once before the first pass (reuse/repairer.py)
  fresh             everything else after the prefix (the last prompt token always is)

A pass computes some positions through the first `num_layers` layers (None: all), writing their KV
over whatever the slots held. The passes of each strategy:
  none        fresh, all layers
  selective   fresh + the first R tokens of every run of reused pieces, the last `overlap` tokens
              before each run and the first `sink` prompt tokens, all layers
  cacheblend  every position after the prefix through layers [0, check_layer]; then fresh + the
              `ratio` of reused tokens whose fresh K at the check layer deviated most from the moved
              K, all layers (the engine picks them when the first pass ends; seam-aware, the first
              `seam_tokens` of every run are picked first)
  query       query-aware: the fresh positions through layers [0, check_layer], the rows after the
              last reused token (the request's question) probed there: their attention over the
              moved KV (reuse/probe.py); then fresh + selective's marks (run starts, the tokens
              before runs, the sink) + the `ratio` of the other reused tokens the question attended
              to most, all layers
The second cacheblend pass recomputes layers [0, check_layer] of its rows with the same inputs the
first pass had, so it writes the same values: the result is CacheBlend's single forward.

Passes are computed in position order, in slices the scheduler fits into ordinary steps beside other
sequences' rows. A row at position p sees the final KV of every position <= p whatever the cut. Where
the storage encodes whole blocks (KIVI's K), a slice also ends on a block boundary (except the pass's
last), so every block is written by one slice per pass and is encoded from the same rows however the
budget cut the pass (`next_slice`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.reuse.plan import ReusePlan

if TYPE_CHECKING:
    import torch


@dataclass
class RepairPass:
    positions: list[int]  # sorted ascending
    num_layers: int | None  # None = every layer
    num_done: int = 0  # positions[:num_done] are computed

    @property
    def finished(self) -> bool:
        return self.num_done == len(self.positions)


@dataclass
class Repair:
    plan: ReusePlan
    num_prompt_tokens: int
    num_layers: int  # the model's
    passes: list[RepairPass]
    reused: list[int]  # positions whose KV was moved in, sorted
    fresh: list[int]  # positions computed because nothing reused covers them, sorted
    moved: bool = False  # the engine has copied the hits in (before the first slice)
    check_k: torch.Tensor | None = None  # cacheblend: the moved K of `reused` at the check layer
    query_mass: torch.Tensor | None = None  # query: attention mass of the question's rows on every position
    token_layers: list[int] = field(init=False)  # rows each layer computed, over all passes

    def __post_init__(self) -> None:
        self.token_layers = [0] * self.num_layers

    @property
    def current(self) -> RepairPass | None:
        return next((p for p in self.passes if not p.finished), None)

    @property
    def awaits_selection(self) -> bool:
        """CacheBlend's or query-aware repair's first pass is done and the second is not yet chosen."""
        selects = self.plan.strategy in ("cacheblend", "query") and self.passes[0].num_layers is not None
        return selects and len(self.passes) == 1 and self.passes[0].finished

    @property
    def probing(self) -> bool:
        """Query-aware repair in its first pass: the question's rows are probed."""
        return self.plan.strategy == "query" and len(self.passes) == 1 and not self.passes[0].finished

    @property
    def finished(self) -> bool:
        return self.current is None and not self.awaits_selection

    def next_slice(self, budget: int, granularity: int) -> list[int]:
        """Positions of the current pass to compute next within `budget` rows: all that are left if
        they fit, else those before the furthest multiple of `granularity` (the block size where
        storage encodes whole blocks, else 1) the budget reaches (empty: none)."""
        cur = self.current
        if cur is None:
            return []
        left = cur.positions[cur.num_done :]
        if len(left) <= budget:
            return left
        # the rows before block boundary b are left[: bisect_left(left, b)]; take the largest that fits
        boundary = left[budget] // granularity * granularity
        return left[: bisect_left(left, boundary)]

    def completes_prompt(self, rows: list[int]) -> bool:
        """Whether computing `rows` (the next slice) ends the last pass through every layer: the
        prompt's last row is then sampled (a preempted and re-admitted repair has decode rows after)."""
        cur = self.current
        return (
            cur is self.passes[-1]
            and cur.num_layers is None
            and cur.num_done + len(rows) == len(cur.positions)
        )

    def computed(self, num_rows: int) -> None:
        cur = self.current
        assert cur is not None
        cur.num_done += num_rows
        for i in range(cur.num_layers or self.num_layers):
            self.token_layers[i] += num_rows

    def seam_positions(self) -> set[int]:
        """CacheBlend, seam-aware: the first seam_tokens positions of every run of reused pieces."""
        plan = self.plan
        return {p for start, end in plan.runs() for p in range(start, min(end, start + plan.seam_tokens))}

    def select(self, chosen: list[int]) -> None:
        """CacheBlend, query: the reused positions to recompute through every layer."""
        assert self.awaits_selection
        self.passes.append(RepairPass(sorted(set(self.fresh) | set(chosen)), None))

    @property
    def num_recomputed(self) -> int:
        """Reused tokens recomputed through every layer (their KV is fresh in the last layer)."""
        last = [p for p in self.passes if p.num_layers is None]
        if not last:
            return 0
        return len(last[-1].positions) - len(self.fresh)


def positions(plan: ReusePlan, n: int) -> tuple[list[int], list[int]]:
    """(reused, fresh) positions of a plan over a prompt of n tokens."""
    is_reused = [False] * n
    for h in plan.hits:
        for p in range(h.dst_start, h.dst_start + h.num_tokens):
            is_reused[p] = True
    reused = [p for p in range(plan.prefix_len, n) if is_reused[p]]
    fresh = [p for p in range(plan.prefix_len, n) if not is_reused[p]]
    assert fresh and fresh[-1] == n - 1, "the last prompt token must be computed"
    return reused, fresh


def query_positions(reused: list[int], fresh: list[int]) -> list[int]:
    """The rows query-aware repair probes: the fresh positions after the last reused one."""
    last = reused[-1] if reused else -1
    return [p for p in fresh if p > last]


def selective_positions(plan: ReusePlan, reused: list[int]) -> list[int]:
    """Reused positions selective repair recomputes: run starts, the tokens before runs, the sink."""
    marks: set[int] = set(range(plan.sink_tokens))
    for start, end in plan.runs():
        marks.update(range(start, min(end, start + plan.recompute_tokens)))
        marks.update(range(max(0, start - plan.overlap_tokens), start))
    return [p for p in reused if p in marks]


def make_repair(plan: ReusePlan, n: int, num_layers: int) -> Repair:
    reused, fresh = positions(plan, n)
    if plan.strategy == "selective":
        passes = [RepairPass(sorted(set(fresh) | set(selective_positions(plan, reused))), None)]
    elif plan.strategy == "cacheblend":
        first_layers = plan.check_layer + 1
        every = list(range(plan.prefix_len, n))
        passes = [RepairPass(every, first_layers if first_layers < num_layers else None)]
    elif plan.strategy == "query":  # the probe needs a layer the first pass stops at
        passes = [RepairPass(fresh, min(plan.check_layer + 1, num_layers - 1))]
    else:
        passes = [RepairPass(fresh, None)]
    return Repair(plan, n, num_layers, passes, reused, fresh)


class Repairs:
    """The content-reuse repairs in progress, by request id: made at admission (Admissions.start),
    scheduled slice by slice (each ScheduledSeq of a repair carries it), advanced by the registrar,
    ended when its last pass is computed (ChunkRegistrar.repair_done), dropped when its sequence leaves
    the pool (a preempted repair is planned again at re-admission)."""

    def __init__(self) -> None:
        self._by_request: dict[str, Repair] = {}

    def start(self, request_id: str, repair: Repair) -> Repair:
        assert request_id not in self._by_request, f"{request_id} is already repairing"
        self._by_request[request_id] = repair
        return repair

    def get(self, request_id: str) -> Repair | None:
        return self._by_request.get(request_id)

    def end(self, request_id: str) -> Repair:
        return self._by_request.pop(request_id)

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def request_ids(self) -> set[str]:
        return set(self._by_request)
