"""The GET /v1/stats body, built on the engine's published EngineStats snapshot."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from kvserve.config import ServeConfig
from kvserve.engine.async_engine import QueueCounters
from kvserve.engine.stats import EngineStats
from kvserve.kvcache.stats import ChunkRow
from kvserve.metrics import Metrics
from kvserve.redact import public_config
from kvserve.stat_table import stat_sections


def stats_body(
    s: EngineStats,
    num_in_system: int,
    counters: QueueCounters,
    metrics: Metrics,
    config: ServeConfig,
    info: Any,
    model_name: str,
) -> dict[str, Any]:
    snapshot = public_config(config)
    declared = stat_sections(s)  # kvserve.stat_table.STATS
    return {
        "queue": {
            **declared["queue"],
            "in_system": num_in_system,
            "max_queue_size": config.max_queue_size,
            **dataclasses.asdict(counters),
        },
        "cache": {**declared["cache"], **_cache(s)},
        "throughput": metrics.throughput(time.monotonic()),
        "tokens": declared["tokens"],
        "latency": {**metrics.latency(), "histograms": metrics.histograms()},
        "model": {
            "id": model_name,
            "device": info.device,
            "dtype": info.dtype,
            "attention_backend": info.attention_backend,
            "model_forward": info.model_forward,
            "max_model_len": info.max_model_len,
            "pool_tokens": info.pool_tokens,
            "kv_layout": info.kv_layout,
        },
        "weights": {**dataclasses.asdict(s.weights), "bytes_per_param": s.weights.bytes_per_param},
        "config": {
            **snapshot,
            # what kv_cache_bits / kv_cold_codec resolved to, with the codec's measured task loss
            "kv_codec_chosen": info.kv_codec,
            "kv_codec_quality": info.kv_codec_quality,
            "kv_cold_codec_chosen": info.kv_cold_codec,
            "kv_cold_codec_quality": info.kv_cold_codec_quality,
        },
        "process": process_stats(),
    }


def chunk_rows_withheld(is_admin: bool, admin_key_set: bool, salted: bool) -> str | None:
    """Why /v1/stats withholds its per-chunk rows (`cache.top_chunks`: prompt lengths, hit counts and
    idle times of every tenant's chunks) from this caller, or None when it shows them. The admin
    key sees them; with no admin key configured, every caller does until a request uses cache_salt
    (tenants who must not see each other's traffic)."""
    if is_admin:
        return None
    if admin_key_set:
        return "the per-chunk rows need the admin key (--admin-api-key)"
    if salted:
        return "withheld since requests use cache_salt; start the server with --admin-api-key to see them"
    return None


def with_chunk_rows(body: dict[str, Any], withheld: str | None) -> dict[str, Any]:
    """A /v1/stats body (a server's, or the cluster's with each replica's under `replicas`) with
    `cache.top_chunks_withheld` set, and every `top_chunks` emptied when it is not None."""
    caches = [body["cache"], *(r["cache"] for r in body.get("replicas", {}).values())]
    for cache in caches:
        if withheld is not None:
            cache["top_chunks"] = []
        cache["top_chunks_withheld"] = withheld
    return body


def process_stats() -> dict[str, Any]:
    """This process's garbage collector: the start-up heap frozen out of its reach
    (kvserve.serving.freeze_startup_heap) and the collections per generation 0, 1, 2."""
    return {
        "gc_frozen_objects": gc.get_freeze_count(),
        "gc_collections": [g["collections"] for g in gc.get_stats()],
    }


def _cache(s: EngineStats) -> dict[str, Any]:
    """The cache section's structured parts (its numbers are declared in kvserve.stat_table.STATS)."""
    return {
        "occupancy_blocks": s.occupancy_blocks,
        "reuse": dataclasses.asdict(s.content_reuse),
        "tiers": {t.tier: dataclasses.asdict(t) for t in s.tiers},
        "top_chunks": [_chunk_row(c, time.monotonic()) for c in s.store.top_chunks],
    }


def _chunk_row(c: ChunkRow, now: float) -> dict[str, Any]:
    row = dataclasses.asdict(c)
    row["idle_s"] = max(0.0, now - row.pop("last_used"))  # the server's monotonic clock means nothing outside
    return row
