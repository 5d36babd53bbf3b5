"""RequestRecord: what the engine keeps for one request in flight, in one place.

Each engine part that keeps something per request keeps it here, not in a table of its own keyed by
request id: the output so far (OutputProcessor's Stream), the weight precisions its steps ran at
(PrecisionPolicy), a pinning warm's booking (WarmPins). The engine holds one record per request from
intake to finish and drops it in one call (`del`), and its integrity check walks the records.

The parts below the engine keep their own per-request books behind their interfaces, each ended by
the one call that ends the request there: the scheduler's sequences and the KV manager's holdings
(Scheduler.finish), content reuse's pieces, repairs and audit traces (ContentReuse.forget, .finished),
a KV tier load (EngineTiers.forget).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.output import Stream
from kvserve.engine.pins import PinBooking
from kvserve.scheduler.sequence import Sequence


@dataclass
class RequestRecord:
    seq: Sequence
    stream: Stream | None = None  # its output so far (None: an audit's recompute, which has no client)
    pin: PinBooking | None = None  # a pinning warm's booking in the store's pin budget
    last_precision: str | None = None  # the weight precision its latest step computed at (NestedFP)
    precisions: set[str] = field(default_factory=set)  # every precision its steps computed at

    @property
    def request_id(self) -> str:
        return self.seq.request_id
