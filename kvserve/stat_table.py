"""The engine's scalar numbers, declared once: each with where /v1/stats shows it, its Prometheus
family, help, unit, and how a cluster merges the replicas' values. The /metrics collector
(kvserve/metrics.py), the /v1/stats sections (api/stats.py), the cluster's merge (cluster/stats.py)
and the dashboard's fields (checked by tests/unit/test_stat_table.py) come from it; adding a number
is one entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.stats import EngineStats


@dataclass(frozen=True)
class Stat:
    """One number the engine reports."""

    path: str | None  # "section.key" in /v1/stats (None: /metrics only)
    prom: str | None  # the Prometheus family (None: /v1/stats only)
    kind: str  # "gauge" or "counter"
    help: str
    unit: str
    # how a cluster merges the replicas' values: "sum"; "first" (the same on every replica); or
    # "ratio:NUM/DEN", recomputed from the summed NUM and DEN of the same section
    merge: str
    value: Callable[[EngineStats], float | int | str]


def _bytes_used(s: EngineStats) -> int:
    return int(s.pool.num_used_blocks * s.bytes_per_token * s.pool.block_size)


STATS: tuple[Stat, ...] = (
    Stat("queue.running", "kvserve:num_requests_running", "gauge", "Requests in the running batch.",
         "requests", "sum", lambda s: s.num_running),
    Stat("queue.waiting", "kvserve:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
         "requests", "sum", lambda s: s.num_waiting),
    Stat("cache.usage", "kvserve:kv_cache_usage_perc", "gauge",
         "Fraction of KV pool blocks in use (blocks of evictable cached chunks count as free).",
         "ratio", "ratio:blocks_used/blocks_total", lambda s: s.pool.usage),
    Stat("cache.cached_bytes", "kvserve:cached_bytes", "gauge", "Bytes of KV held by cached chunks.",
         "bytes", "sum", lambda s: s.store.cached_bytes),
    Stat("cache.bytes_budget", "kvserve:cache_budget_bytes", "gauge", "KV memory budget (max_cache_bytes).",
         "bytes", "sum", lambda s: s.store.max_cache_bytes),
    Stat("cache.chunks", "kvserve:cached_chunks", "gauge", "Chunks in the prefix cache.",
         "chunks", "sum", lambda s: s.store.num_chunks),
    Stat("cache.pinned_chunks", "kvserve:pinned_chunks", "gauge", "Pinned chunks in the prefix cache.",
         "chunks", "sum", lambda s: s.store.num_pinned_chunks),
    Stat("cache.blocks_used", None, "gauge", "KV pool blocks off the free list.",
         "blocks", "sum", lambda s: s.pool.num_used_blocks),
    Stat("cache.blocks_total", None, "gauge", "KV pool blocks.", "blocks", "sum", lambda s: s.pool.num_blocks),
    Stat("cache.cached_blocks", None, "gauge", "Blocks held by cached chunks.",
         "blocks", "sum", lambda s: s.store.num_cached_blocks),
    Stat("cache.evictable_blocks", None, "gauge", "Blocks eviction can reclaim on demand.",
         "blocks", "sum", lambda s: s.pool.num_evictable_blocks),
    Stat("cache.bytes_used", None, "gauge", "Bytes of KV in blocks off the free list.",
         "bytes", "sum", _bytes_used),
    Stat("cache.bytes_per_token", None, "gauge", "KV bytes per token under the codec.",
         "bytes", "first", lambda s: s.bytes_per_token),
    Stat("cache.codec", None, "gauge", "The KV codec.", "", "first", lambda s: s.kv_codec),
    Stat("cache.query_tokens", "kvserve:prefix_cache_queries", "counter",
         "Prompt tokens looked up in the prefix cache.", "tokens", "sum", lambda s: s.num_query_tokens),
    Stat("cache.hit_tokens", "kvserve:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
         "tokens", "sum", lambda s: s.num_hit_tokens),
    Stat("cache.hit_rate", None, "gauge", "Prefix cache hits over queries, in tokens.",
         "ratio", "ratio:hit_tokens/query_tokens", lambda s: s.hit_rate),
    Stat(None, "kvserve:prompt_tokens", "counter", "Prompt tokens of admitted requests.",
         "tokens", "sum", lambda s: s.num_query_tokens),
    Stat("tokens.prompt_tokens_computed", "kvserve:prompt_tokens_computed", "counter",
         "Prompt tokens computed (not cached).", "tokens", "sum", lambda s: s.num_prompt_tokens_computed),
    Stat("tokens.generated_tokens", "kvserve:generation_tokens", "counter", "Generated tokens.",
         "tokens", "sum", lambda s: s.num_generated_tokens),
    Stat("cache.evictions", "kvserve:cache_evictions", "counter", "Chunks evicted from the prefix cache.",
         "chunks", "sum", lambda s: s.num_evictions),
    Stat("queue.preemptions", "kvserve:num_preemptions", "counter", "Sequences preempted for memory.",
         "sequences", "sum", lambda s: s.num_preemptions),
    Stat(None, "kvserve:approx_reused_tokens", "counter",
         "Prompt tokens reused from content matches (content reuse, before repair).",
         "tokens", "sum", lambda s: s.content_reuse.num_approx_hit_tokens),
    Stat(None, "kvserve:repair_recomputed_tokens", "counter",
         "Reused tokens recomputed by the repair (selective / cacheblend).",
         "tokens", "sum", lambda s: s.content_reuse.num_recomputed_tokens),
)  # fmt: skip


def stat_sections(s: EngineStats) -> dict[str, dict[str, float | int | str]]:
    """The declared numbers of /v1/stats, by section: {"queue": {...}, "cache": {...}, ...}."""
    out: dict[str, dict[str, float | int | str]] = {}
    for stat in STATS:
        if stat.path is not None:
            section, key = stat.path.split(".")
            out.setdefault(section, {})[key] = stat.value(s)
    return out
