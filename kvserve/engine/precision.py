"""Which weight precision a step computes at, with NestedFP weights (models/nested.py).

`--weight-precision fp16` or `fp8` fixes it. `auto` follows load, checked every step and at every
admission:
- it moves to **fp8** when the latency objective is at risk: `--fp8-queue-depth` or more requests
  wait to be scheduled, or the time-to-first-token p90 of the recent first tokens (the last 32 within
  `WINDOW_S`) is over `--slo-ttft-ms`;
- back to **fp16** once it is safe by a margin: at most half that many wait, and the p90 is
  at most `CALM_FRACTION` of the objective (or there are no recent first tokens), and fp8 has held for
  `--precision-hold-s`. The two thresholds and the hold are the hysteresis: without them a queue that
  sits at the threshold would flip the mode every step.

As in the seed, the precision is a property of the step: every row of a step computes at the mode of
the moment (a request pinned to a precision, an audit, at its own). The cache stays exact per precision
because a request's root hash names the precision it was admitted at, and a request that goes on at
the other one (auto switched) stops caching from the chunk where that began
(`ChunkRegistrar.limit`): cached KV is only ever KV its namespace's precision computed, so a request
served at one precision throughout gets the same answer with the cache on or off. Requests report every
precision they ran at ("fp16", "fp8" or "fp16+fp8").
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.config_slices import ModelConfig
from kvserve.scheduler.batch import ScheduledSeq
from kvserve.scheduler.registration import ChunkRegistrar

if TYPE_CHECKING:
    from kvserve.engine.requests import RequestRecord

PRECISIONS = ("fp16", "fp8")

WINDOW_S = 10.0  # first tokens older than this no longer count for the p90
CALM_FRACTION = 0.7  # back to fp16 only when the p90 is this far under the objective


@dataclass(frozen=True)
class WeightStats:
    """The model's weights: what they take, and with NestedFP the precisions requests were served at."""

    precision: str  # --weight-precision: dense, fp16, fp8 or auto
    mode: str | None  # what a request admitted now gets (auto moves it); None with dense weights
    weight_bytes: int
    num_params: int
    num_switches: int  # auto: fp16 <-> fp8 moves so far
    ttft_p90_s: float | None  # auto: the recent time-to-first-token p90 it judges by
    requests: dict[str, int]  # requests admitted, by precision
    generated_tokens: dict[str, int]  # tokens generated, by the precision of the step that computed them

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes / self.num_params if self.num_params else 0.0


class PrecisionPolicy:
    def __init__(self, config: ModelConfig):
        self.setting = config.weight_precision  # dense, fp16, fp8 or auto
        self.slo_s = config.slo_ttft_ms / 1000.0
        self.queue_depth = config.fp8_queue_depth
        self.hold_s = config.precision_hold_s
        self.mode: str | None = (
            None if self.setting == "dense" else "fp16" if self.setting == "auto" else self.setting
        )
        self.switched_at = -math.inf
        self.num_switches = 0
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=32)  # (when, seconds)
        self.requests: Counter[str] = Counter()  # requests admitted, by precision
        self.tokens: Counter[str] = Counter()  # tokens sampled, by the precision that computed them

    @property
    def nested(self) -> bool:
        return self.setting != "dense"

    def assign(self, num_waiting: int, now: float) -> str | None:
        """The precision a request admitted now is named by (None: dense weights)."""
        self.update(num_waiting, now)
        if self.mode is not None:
            self.requests[self.mode] += 1
        return self.mode

    def apply(
        self,
        items: list[ScheduledSeq],
        records: Mapping[str, RequestRecord],
        chunks: ChunkRegistrar,
        chunk_size: int,
    ) -> None:
        """Before a step's forward: every row computes at the mode now (a request pinned to a precision,
        such as an audit, at its own). A sequence computing at another precision than the one it was
        admitted at (auto switched) stops caching from the chunk these rows fall in: its cached KV is
        only ever what its root hash names. Each request's record keeps the precisions its steps ran at."""
        if not self.nested:
            return
        for item in items:
            seq = item.seq
            precision = seq.request.weight_precision or self.mode
            assert precision is not None  # nested: there is always a mode
            item.precision = precision
            record = records[seq.request_id]
            record.last_precision = precision
            record.precisions.add(precision)
            if precision != seq.precision:
                first = item.positions[0] if item.positions is not None else seq.num_computed_tokens
                chunks.limit(seq, first // chunk_size)
            if item.sample:
                self.tokens[precision] += 1

    @staticmethod
    def served_at(record: RequestRecord) -> str | None:
        """What the request's output reports: every precision its steps ran at ("fp16+fp8" when auto
        moved it), else the one it was admitted at."""
        return "+".join(sorted(record.precisions)) or record.seq.precision

    def observe_ttft(self, seconds: float, now: float) -> None:
        self._ttfts.append((now, seconds))

    def stats(self, weight_bytes: int, num_params: int) -> WeightStats:
        return WeightStats(
            precision=self.setting,
            mode=self.mode,
            weight_bytes=weight_bytes,
            num_params=num_params,
            num_switches=self.num_switches,
            ttft_p90_s=self.ttft_p90(time.monotonic()) if self.setting == "auto" else None,
            requests=dict(self.requests),
            generated_tokens=dict(self.tokens),
        )

    def ttft_p90(self, now: float) -> float | None:
        recent = sorted(s for t, s in self._ttfts if now - t <= WINDOW_S)
        if not recent:
            return None
        return recent[min(len(recent) - 1, math.ceil(0.9 * len(recent)) - 1)]

    def update(self, num_waiting: int, now: float) -> None:
        """auto: move between fp16 and fp8 by the load now (see the module docstring)."""
        if self.setting != "auto":
            return
        p90 = self.ttft_p90(now)
        if self.mode == "fp16":
            late = self.slo_s > 0 and p90 is not None and p90 > self.slo_s
            if num_waiting >= self.queue_depth or late:
                self._switch("fp8", now)
        else:
            calm_queue = num_waiting <= self.queue_depth // 2
            calm_ttft = self.slo_s <= 0 or p90 is None or p90 <= CALM_FRACTION * self.slo_s
            if calm_queue and calm_ttft and now - self.switched_at >= self.hold_s:
                self._switch("fp16", now)

    def _switch(self, mode: str, now: float) -> None:
        self.mode, self.switched_at = mode, now
        self.num_switches += 1
