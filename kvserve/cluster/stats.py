"""Cluster-wide /v1/stats and /metrics from the replicas' own (each a `kvserve serve` body).

/v1/stats sums what adds up (queues, blocks, bytes, tokens, tier counters), recomputes the ratios
from the sums, takes latency and throughput from the ingress (what clients saw), and keeps every
replica's whole body under `replicas`. /metrics is every replica's exposition with a `replica` label
on each sample."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvserve.api.stats import process_stats
from kvserve.cluster import routing
from kvserve.cluster.config import ClusterConfig
from kvserve.kvcache.stats import TOP_CHUNKS
from kvserve.metrics import Metrics
from kvserve.stat_table import STATS

SHARED_TIERS = ("redis",)  # one store seen by every replica: its size is counted once


def _sum(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key; other values from the first row."""
    out: dict[str, Any] = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = sum(row.get(key, 0) for row in rows)
    return out


def _tiers(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in dict.fromkeys(t for row in rows for t in row):
        tier_rows = [row[name] for row in rows if name in row]
        merged = _sum(tier_rows)
        merged["load_seconds_max"] = max(r["load_seconds_max"] for r in tier_rows)
        if name in SHARED_TIERS:
            merged["bytes"] = max(r["bytes"] for r in tier_rows)
            merged["chunks"] = max(r["chunks"] for r in tier_rows)
        out[name] = merged
    return out


def _top_chunks(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The replicas' most reused chunks, each row naming its replica, the most reused first."""
    rows = [{**row, "replica": b["replica"]} for b in bodies for row in b["cache"]["top_chunks"]]
    rows.sort(key=lambda r: (r["num_hits"], -r["idle_s"]), reverse=True)
    return rows[:TOP_CHUNKS]


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def merge_declared(section: str, rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The replicas' declared numbers of one /v1/stats section, merged as kvserve.stat_table.STATS says:
    summed, taken from the first replica, or a ratio recomputed from the sums."""
    merged: dict[str, Any] = {}
    ratios: list[tuple[str, str, str]] = []
    for stat in STATS:
        if stat.path is None or not stat.path.startswith(section + "."):
            continue
        key = stat.path.split(".", 1)[1]
        if stat.merge == "sum":
            merged[key] = sum(row[key] for row in rows)
        elif stat.merge == "first":
            merged[key] = rows[0][key]
        else:  # "ratio:NUM/DEN"
            num, den = stat.merge.removeprefix("ratio:").split("/")
            ratios.append((key, num, den))
    for key, num, den in ratios:
        merged[key] = _ratio(merged[num], merged[den])
    return merged


def cluster_stats(bodies: list[dict[str, Any]], ingress: Metrics, cluster: ClusterConfig) -> dict[str, Any]:
    bodies = sorted(bodies, key=lambda b: b["replica"])
    caches = [b["cache"] for b in bodies]
    cache = merge_declared("cache", caches)
    cache.update(
        reuse=_sum([c["reuse"] for c in caches]),
        tiers=_tiers([c["tiers"] for c in caches]),
        occupancy_blocks=_sum([c["occupancy_blocks"] for c in caches]),
        top_chunks=_top_chunks(bodies),
    )
    decisions = routing.decisions()
    routed = sum(decisions.values())
    return {
        "cluster": {
            "replicas": len(bodies),
            "routing": {
                "policy": cluster.routing,
                "affinity_chunks": cluster.affinity_chunks,
                "load_factor": cluster.load_factor,
                "decisions": decisions,
                "affinity_rate": _ratio(decisions.get("affinity", 0), routed),
            },
        },
        "queue": _sum([b["queue"] for b in bodies]),
        "cache": cache,
        "throughput": ingress.throughput(time.monotonic()),
        "tokens": merge_declared("tokens", [b["tokens"] for b in bodies]),
        "latency": {**ingress.latency(), "histograms": ingress.histograms()},
        "model": bodies[0]["model"],
        "config": bodies[0]["config"],
        "process": process_stats(),  # the ingress's own; each replica's is under `replicas`
        "replicas": {b["replica"]: {k: v for k, v in b.items() if k != "config"} for b in bodies},
    }


def merge_metrics(expositions: Mapping[str, bytes]) -> bytes:
    """One Prometheus exposition from the replicas', each sample labelled with its replica."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))

    class Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
