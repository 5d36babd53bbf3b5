"""What the engine reports about itself: pool, store, queue, reuse and token counters, as one typed
value that `Engine.stats` puts together, on the thread that drives the engine, from the value each
part reports (its `stats()`).

Its cost is one pass over the cached chunks (pinned chunks and evictable blocks are counted, not
tracked), so AsyncEngine publishes it after steps at a bounded rate rather than per read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.engine.precision import WeightStats
from kvserve.kvcache.stats import PoolStats, StoreStats
from kvserve.reuse import ContentReuseStats
from kvserve.scheduler.scheduler import SchedulerStats
from kvserve.tiers.manager import TierStats


def fields_of(value: Any) -> dict[str, Any]:
    """A dataclass value's fields by name, not copied (dataclasses.asdict would turn nested values into
    dicts)."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    """The scheduler's counters (SchedulerStats: queries, hits, running, waiting, ...) and the rest."""

    model: str
    kv_codec: str
    bytes_per_token: float
    pool: PoolStats
    store: StoreStats
    content_reuse: ContentReuseStats
    num_generated_tokens: int
    num_steps: int
    weights: WeightStats
    # the hot pool and each tier below it (tiers/), when any tier is configured
    tiers: list[TierStats] = dataclasses.field(default_factory=list)
    # kept decoded blocks (kv_decoded_bytes): bytes held, blocks decoded into them, block reads they served
    decoded_bytes: int = 0
    num_decoded_blocks: int = 0
    num_decoded_reused: int = 0
    # steps that raised (a bug: every request in flight failed), and rebuilds of the engine's state
    # after one left its books disagreeing, with what disagreed the last time (Engine.recover)
    num_step_failures: int = 0
    num_engine_restarts: int = 0
    last_restart_reason: str = ""

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def num_evictions(self) -> int:
        return self.store.num_evicted_chunks

    @property
    def occupancy_blocks(self) -> dict[str, int]:
        """The pool's blocks by state, summing to its size: free; evictable (cached chunks eviction can
        reclaim); pinned (warmed chunks); in_use (held by running requests and the cached chunks they
        use). ("hot" and "cold" name KV tiers only: the pool, and the lossy area below it.)"""
        pool, store = self.pool, self.store
        evictable, pinned = pool.num_evictable_blocks, store.num_pinned_blocks
        return {
            "in_use": pool.num_used_blocks - evictable - pinned,
            "evictable": evictable,
            "pinned": pinned,
            "free": pool.num_free_blocks,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate, "num_evictions": self.num_evictions}
