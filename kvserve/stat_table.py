"""Every number kvserve reports, declared once.

- `STATS`: the engine's scalar numbers, each with where /v1/stats shows it, its Prometheus family,
  help, unit, and how a cluster merges the replicas' values.
- `FAMILIES`: the engine's labelled Prometheus families (blocks by state, per tier, per weight
  precision, per audit strategy): name, kind, help, unit, labels and the samples.
- `OBSERVED`: what the API process observes from each request's outputs (latency histograms, finished
  and refused requests): name, kind, help, unit, labels and buckets.

The /metrics collector and histograms (kvserve/metrics.py), the /v1/stats sections (api/stats.py), the
cluster's merge (cluster/stats.py) and the dashboard's "All numbers" table (`declared_fields`) come
from it; tests/unit/test_stat_table.py fails on a /metrics family declared anywhere else and on a
dashboard card reading an undeclared number. Adding a number is one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine.precision import PRECISIONS

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
    Stat("queue.running", "kvserve:num_requests_running", "gauge",
         "Client requests in the running batch (background sequences are counted apart).",
         "requests", "sum", lambda s: s.num_running),
    Stat("queue.waiting", "kvserve:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
         "requests", "sum", lambda s: s.num_waiting),
    Stat("queue.background_running", "kvserve:num_background_running", "gauge",
         "Background sequences (audits' full recomputes) admitted; they step only while no request runs or "
         "waits.", "sequences", "sum", lambda s: s.num_background_running),
    Stat("queue.background_waiting", "kvserve:num_background_waiting", "gauge",
         "Background sequences (audits' full recomputes) waiting for an idle step.",
         "sequences", "sum", lambda s: s.num_background_waiting),
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
    Stat("cache.decoded_bytes", None, "gauge",
         "Bytes of decoded block copies kept across steps (kv_decoded_bytes; part of the budget).",
         "bytes", "sum", lambda s: s.decoded_bytes),
    Stat("cache.decoded_blocks", None, "counter",
         "Blocks decoded into kept copies (each decoded once until written again).",
         "blocks", "sum", lambda s: s.num_decoded_blocks),
    Stat("cache.decoded_reused_blocks", None, "counter",
         "Block reads by attention served by a kept decoded copy instead of a fresh decode.",
         "blocks", "sum", lambda s: s.num_decoded_reused),
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
    Stat("queue.step_failures", "kvserve:engine_step_failures", "counter",
         "Engine steps that raised (a bug): every request in flight failed, then the books were checked.",
         "steps", "sum", lambda s: s.num_step_failures),
    Stat("queue.engine_restarts", "kvserve:engine_restarts", "counter",
         "Rebuilds of the engine's KV state after a failed step left its books disagreeing.",
         "restarts", "sum", lambda s: s.num_engine_restarts),
    Stat("queue.last_restart_reason", None, "gauge",
         "What disagreed at the last rebuild of the engine's state (empty: none yet).",
         "", "first", lambda s: s.last_restart_reason),
    Stat(None, "kvserve:approx_reused_tokens", "counter",
         "Prompt tokens reused from content matches (content reuse, before repair).",
         "tokens", "sum", lambda s: s.content_reuse.num_approx_hit_tokens),
    Stat(None, "kvserve:repair_recomputed_tokens", "counter",
         "Reused tokens recomputed by the repair (selective / cacheblend).",
         "tokens", "sum", lambda s: s.content_reuse.num_recomputed_tokens),
    Stat(None, "kvserve:reuse_auto_fell_back", "gauge",
         "1 once --recompute-strategy auto stopped repairing with its verified preset because the online "
         "audits agreed clearly less than the verification did (0: repairing, or no preset; summed over "
         "a cluster's replicas).",
         "replicas", "sum", lambda s: float(bool(s.content_reuse.auto["fell_back"]))),
)  # fmt: skip


def declared_fields() -> list[dict[str, str]]:
    """The /v1/stats numbers the dashboard lists in "All numbers": path, unit and help of each declared
    one, in the table's order (GET /dashboard/fields.json; no data, so open like the page)."""
    return [{"path": s.path, "unit": s.unit, "help": s.help} for s in STATS if s.path is not None]


def stat_sections(s: EngineStats) -> dict[str, dict[str, float | int | str]]:
    """The declared numbers of /v1/stats, by section: {"queue": {...}, "cache": {...}, ...}."""
    out: dict[str, dict[str, float | int | str]] = {}
    for stat in STATS:
        if stat.path is not None:
            section, key = stat.path.split(".")
            out.setdefault(section, {})[key] = stat.value(s)
    return out


Samples = Iterable[tuple[tuple[str, ...], float]]  # (label values after model_name, value)


@dataclass(frozen=True)
class Family:
    """A labelled Prometheus family of the engine's numbers: one sample per label value."""

    prom: str
    kind: str  # "gauge" or "counter"
    help: str
    unit: str
    labels: tuple[str, ...]  # after model_name
    samples: Callable[[EngineStats], Samples]
    shown: Callable[[EngineStats], bool] = lambda s: True  # exported only when this holds


def _with_nestedfp(s: EngineStats) -> bool:
    return s.weights.mode is not None


def _tier(attr: str) -> Callable[[EngineStats], Samples]:
    return lambda s: [((t.tier,), float(getattr(t, attr))) for t in s.tiers]


def _precision(read: Callable[[EngineStats, str], float]) -> Callable[[EngineStats], Samples]:
    return lambda s: [((p,), float(read(s, p))) for p in PRECISIONS]


def _audit(attr: str) -> Callable[[EngineStats], Samples]:
    return lambda s: [((strategy,), float(getattr(a, attr))) for strategy, a in s.content_reuse.audit.items()]


def _audit_quantiles(prefix: str) -> Callable[[EngineStats], Samples]:
    quantiles = (("0.5", "p50"), ("0.95", "p95"), ("1", "max"))
    return lambda s: [
        ((strategy, q), float(getattr(a, f"{prefix}_{suffix}")))
        for strategy, a in s.content_reuse.audit.items()
        for q, suffix in quantiles
    ]


FAMILIES: tuple[Family, ...] = (
    Family("kvserve:kv_cache_blocks", "gauge",
           "The KV pool's blocks by state (sum: the pool): in_use (running requests and the chunks they "
           "use), pinned, evictable (cached, reclaimable), free.", "blocks", ("state",),
           lambda s: [((state,), float(n)) for state, n in s.occupancy_blocks.items()]),
    Family("kvserve:reuse_plans", "counter",
           "Prompts with content matches by the cost-aware decision (taken, or declined and why).",
           "prompts", ("decision",),
           lambda s: [((d,), float(n)) for d, n in s.content_reuse.plans.items()]),
    Family("kvserve:audit_first_token_kl", "gauge",
           "Audited first-token KL(full prefill || served), nats, by repair strategy (quantile 1 = max).",
           "nats", ("strategy", "quantile"), _audit_quantiles("kl")),
    Family("kvserve:audits", "counter", "Approximately reused prompts recomputed in full by the audit.",
           "prompts", ("strategy",), _audit("num_audited")),
    Family("kvserve:audit_top1_agreement", "gauge",
           "Share of audited prompts whose served first token's top-1 equals the full prefill's.",
           "ratio", ("strategy",), _audit("top1_agreement")),
    Family("kvserve:audit_mean_kl", "gauge",
           "Audited KL(full prefill || served), nats, averaged along each request's served tokens (up to "
           "--audit-tokens), by repair strategy; quantiles over requests (1 = max).",
           "nats", ("strategy", "quantile"), _audit_quantiles("mean_kl")),
    Family("kvserve:audit_greedy_agreement", "gauge",
           "Share of audited served tokens that are the full prefill's greedy choice at their position.",
           "ratio", ("strategy",), _audit("greedy_agreement")),
    Family("kvserve:audit_guard_fired", "counter",
           "Audits whose mean KL is over --audit-max-kl (their documents are guarded).", "audits", (),
           lambda s: [((), float(s.content_reuse.num_guard_fired))]),
    Family("kvserve:audit_guard_skipped_matches", "counter",
           "Content matches skipped: their document is guarded.", "matches", (),
           lambda s: [((), float(s.content_reuse.num_guard_skips))]),
    Family("kvserve:audits_dropped", "counter", "Audits not run (too many pending, or the recompute failed).",
           "audits", (), lambda s: [((), float(s.content_reuse.num_audits_dropped))]),
    Family("kvserve:audits_requested", "counter",
           "Requests served with approximate reuse that asked for an audit (audit: true).", "requests", (),
           lambda s: [((), float(s.content_reuse.num_audits_requested))]),
    Family("kvserve:audits_over_budget", "counter",
           "Requested audits refused: past --audit-requests-per-minute (served without one).", "requests", (),
           lambda s: [((), float(s.content_reuse.num_audits_over_budget))]),
    Family("kvserve:weight_bytes", "gauge", "Bytes the model's weights take.", "bytes", (),
           lambda s: [((), float(s.weights.weight_bytes))]),
    Family("kvserve:weight_precision", "gauge",
           "1 for the weight precision a request admitted now gets (NestedFP), 0 for the other.", "",
           ("precision",), _precision(lambda s, p: s.weights.mode == p), _with_nestedfp),
    Family("kvserve:weight_precision_requests", "counter",
           "Requests admitted, by the weight precision they are served at.", "requests", ("precision",),
           _precision(lambda s, p: s.weights.requests.get(p, 0)), _with_nestedfp),
    Family("kvserve:weight_precision_generation_tokens", "counter",
           "Tokens generated, by the weight precision of the step that computed them.", "tokens",
           ("precision",), _precision(lambda s, p: s.weights.generated_tokens.get(p, 0)), _with_nestedfp),
    Family("kvserve:weight_precision_switches", "counter", "Moves between fp16 and fp8 (auto).", "switches",
           (), lambda s: [((), float(s.weights.num_switches))], _with_nestedfp),
    Family("kvserve:tier_bytes", "gauge", "Bytes of KV a tier holds.", "bytes", ("tier",), _tier("bytes")),
    Family("kvserve:tier_chunks", "gauge", "Chunks a tier holds.", "chunks", ("tier",), _tier("chunks")),
    Family("kvserve:tier_hits", "counter", "Chunk lookups a tier answered.", "hits", ("tier",), _tier("hits")),
    Family("kvserve:tier_loads", "counter", "Chunks loaded from a tier into the hot pool.", "loads",
           ("tier",), _tier("loads")),
    Family("kvserve:tier_load_seconds", "counter",
           "Seconds spent loading chunks from a tier (divide by tier_loads for the mean).", "seconds",
           ("tier",), _tier("load_seconds_total")),
    Family("kvserve:tier_corruptions", "counter", "Damaged or foreign entries a tier detected and removed.",
           "entries", ("tier",), _tier("corruptions")),
    Family("kvserve:tier_fallbacks", "counter",
           "Lookups or loads a tier could not serve (down, no room, unfit): computed instead.", "lookups",
           ("tier",), _tier("fallbacks")),
    Family("kvserve:tier_writes", "counter", "Chunks written to a tier.", "chunks", ("tier",), _tier("writes")),
    Family("kvserve:tier_write_errors", "counter", "Writes to a tier that failed.", "writes", ("tier",),
           _tier("write_errors")),
)  # fmt: skip


LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
QUEUE_BUCKETS = (*LATENCY_BUCKETS, 30.0, 60.0, 120.0, 300.0, 600.0)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


@dataclass(frozen=True)
class Observed:
    """A number the API process observes from requests' outputs (kvserve.metrics.Metrics), by key."""

    key: str  # Metrics.observed[key]
    prom: str
    kind: str  # "histogram" or "counter"
    help: str
    unit: str
    labels: tuple[str, ...] = ()  # after model_name
    buckets: Callable[[int], tuple[float, ...]] = lambda max_model_len: LATENCY_BUCKETS  # histograms


OBSERVED: tuple[Observed, ...] = (
    Observed("ttft", "kvserve:time_to_first_token_seconds", "histogram", "Time to first token.", "seconds"),
    Observed("itl", "kvserve:inter_token_latency_seconds", "histogram", "Time between generated tokens.",
             "seconds"),
    Observed("e2e", "kvserve:e2e_request_latency_seconds", "histogram", "Request latency from arrival to finish.",
             "seconds"),
    Observed("queue_time", "kvserve:request_queue_time_seconds", "histogram",
             "Time a request waited from arrival to its first scheduled step.", "seconds",
             buckets=lambda max_model_len: QUEUE_BUCKETS),
    Observed("prompt_tokens", "kvserve:request_prompt_tokens", "histogram", "Prompt tokens per finished request.",
             "tokens", buckets=one_two_five_buckets),
    Observed("finished", "kvserve:request_success", "counter", "Finished requests by finish reason.",
             "requests", ("finished_reason",)),
    Observed("rejected", "kvserve:request_rejected", "counter", "Requests refused with 503 (queue full).",
             "requests"),
)  # fmt: skip
