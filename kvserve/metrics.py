"""Counters and histograms behind /v1/stats and /metrics.

Latencies and token rates are observed from RequestOutputs on the engine's worker thread; cache and
queue facts come from the EngineStats snapshot the worker last published (`engine_stats`).
Prometheus names follow vLLM's where one exists (with the `kvserve:` prefix).

The engine's scalar numbers are declared once, in kvserve/stat_table.py (`STATS`); the collector
here exports them, and the labelled families (tiers, weights, audits, block states) are built below
from their stats.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.engine.precision import PRECISIONS
from kvserve.engine.stats import ContentReuseStats, EngineStats, WeightStats
from kvserve.request import RequestOutput
from kvserve.stat_table import STATS
from kvserve.tiers.manager import TierStats

WINDOW_S = 60.0
_LATENCY_BUCKETS = (
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
_QUEUE_BUCKETS = (*_LATENCY_BUCKETS, 30.0, 60.0, 120.0, 300.0, 600.0)


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


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 131072):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between generated tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds",
            "Request latency from arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "kvserve:request_queue_time_seconds",
            "Time a request waited from arrival to its first scheduled step.",
            labels,
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Histogram(
            "kvserve:request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            buckets=one_two_five_buckets(max_model_len),
            registry=self.registry,
        )
        self.finished = Counter(
            "kvserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvserve:request_rejected",
            "Requests refused with 503 (queue full).",
            labels,
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(self))
        self._lock = threading.Lock()
        self._last_token_time: dict[str, float] = {}
        self._events: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self._ttft_s: deque[float] = deque(maxlen=4096)
        self._itl_s: deque[float] = deque(maxlen=4096)
        self.engine_stats: EngineStats | None = None

    # --- observation (worker thread) -----------------------------------------------------------------
    def observe(self, out: RequestOutput, now: float) -> None:
        num_new = len(out.new_token_ids)
        with self._lock:
            last = self._last_token_time.get(out.request_id)
            num_prompt = 0
            if num_new and last is None:
                num_prompt = out.num_prompt_tokens - out.num_cached_tokens
                ttft = out.metrics.ttft_s
                if ttft is not None:
                    self._ttft_s.append(ttft)
                    self.ttft.labels(self.model_name).observe(ttft)
            elif num_new and last is not None:
                gap = (now - last) / num_new
                self._itl_s.append(gap)
                self.itl.labels(self.model_name).observe(gap)
            if num_new:
                self._last_token_time[out.request_id] = now
            self._events.append((now, num_prompt, num_new))
            self._trim(now)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
        if out.finished:
            reason = out.finish_reason.value if out.finish_reason else "error"
            self.finished.labels(self.model_name, reason).inc()
            m = out.metrics
            if m.e2e_s is not None:
                self.e2e.labels(self.model_name).observe(m.e2e_s)
            if m.first_scheduled_time is not None:
                self.queue_time.labels(self.model_name).observe(m.first_scheduled_time - m.arrival_time)
            self.prompt_tokens.labels(self.model_name).observe(out.num_prompt_tokens)

    def on_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > WINDOW_S:
            self._events.popleft()

    # --- reading -----------------------------------------------------------------------------------
    def throughput(self, now: float) -> dict[str, float]:
        with self._lock:
            self._trim(now)
            prompt = sum(e[1] for e in self._events)
            generated = sum(e[2] for e in self._events)
        return {
            "window_s": WINDOW_S,
            "prompt_tokens_per_s": prompt / WINDOW_S,
            "generation_tokens_per_s": generated / WINDOW_S,
        }

    def latency(self) -> dict[str, dict[str, float | int]]:
        with self._lock:
            ttft, itl = sorted(self._ttft_s), sorted(self._itl_s)
        return {"ttft_s": _percentiles(ttft), "inter_token_s": _percentiles(itl)}

    def histograms(self) -> dict[str, dict[str, list[float] | list[int]]]:
        """TTFT and inter-token latency as bucket counts (not cumulative): `counts[i]` observations
        at most `bounds[i]` seconds and over the bound before, the last one over every bound."""
        out: dict[str, dict[str, list[float] | list[int]]] = {}
        for key, hist in (("ttft_s", self.ttft), ("inter_token_s", self.itl)):
            cumulative = [
                int(sample.value)
                for family in hist.collect()
                for sample in family.samples
                if sample.name.endswith("_bucket") and sample.labels.get("model_name") == self.model_name
            ]
            counts = [b - a for a, b in itertools.pairwise([0, *cumulative])]
            out[key] = {
                "bounds": list(_LATENCY_BUCKETS),
                "counts": counts or [0] * (len(_LATENCY_BUCKETS) + 1),
            }
        return out

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)


def _percentiles(values: list[float]) -> dict[str, float | int]:
    """p50/p95/p99 of sorted `values` (nearest rank); zeros when there are none."""
    out: dict[str, float | int] = {"count": len(values)}
    for p in (50, 95, 99):
        out[f"p{p}"] = values[min(len(values) - 1, int(p / 100 * len(values)))] if values else 0.0
    return out


class _EngineStatsCollector:
    """Exposes the latest engine.stats() snapshot as Prometheus gauges and counters."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self.metrics.engine_stats
        if s is None:
            return
        name = self.metrics.model_name
        for stat in STATS:
            if stat.prom is None:
                continue
            family = GaugeMetricFamily if stat.kind == "gauge" else CounterMetricFamily
            metric = family(stat.prom, stat.help, labels=["model_name"])
            metric.add_metric([name], float(stat.value(s)))
            yield metric
        blocks = GaugeMetricFamily(
            "kvserve:kv_cache_blocks",
            "The KV pool's blocks by state (sum: the pool): in_use (running requests and the chunks they "
            "use), pinned, evictable (cached, reclaimable), free.",
            labels=["model_name", "state"],
        )
        for state, n in s.occupancy_blocks.items():
            blocks.add_metric([name, state], float(n))
        yield blocks
        yield from _reuse_quality(name, s.content_reuse)
        yield from _weights(name, s.weights)
        yield from _tiers(name, s.tiers)


def _weights(name: str, w: WeightStats) -> Iterator[Metric]:
    """The weights' bytes; with NestedFP, the precision new requests get and what each was served at."""
    size = GaugeMetricFamily("kvserve:weight_bytes", "Bytes the model's weights take.", labels=["model_name"])
    size.add_metric([name], float(w.weight_bytes))
    yield size
    if w.mode is None:
        return
    mode = GaugeMetricFamily(
        "kvserve:weight_precision",
        "1 for the weight precision a request admitted now gets (NestedFP), 0 for the other.",
        labels=["model_name", "precision"],
    )
    requests = CounterMetricFamily(
        "kvserve:weight_precision_requests",
        "Requests admitted, by the weight precision they are served at.",
        labels=["model_name", "precision"],
    )
    tokens = CounterMetricFamily(
        "kvserve:weight_precision_generation_tokens",
        "Tokens generated, by the weight precision of the step that computed them.",
        labels=["model_name", "precision"],
    )
    for precision in PRECISIONS:
        mode.add_metric([name, precision], float(w.mode == precision))
        requests.add_metric([name, precision], float(w.requests.get(precision, 0)))
        tokens.add_metric([name, precision], float(w.generated_tokens.get(precision, 0)))
    switches = CounterMetricFamily(
        "kvserve:weight_precision_switches", "Moves between fp16 and fp8 (auto).", labels=["model_name"]
    )
    switches.add_metric([name], float(w.num_switches))
    yield from (mode, requests, tokens, switches)


def _tiers(name: str, tiers: list[TierStats]) -> Iterator[Metric]:
    """Per KV tier (hot, cold, disk, redis): what it holds, what it served, what failed."""
    families = [
        (GaugeMetricFamily, "kvserve:tier_bytes", "Bytes of KV a tier holds.", "bytes"),
        (GaugeMetricFamily, "kvserve:tier_chunks", "Chunks a tier holds.", "chunks"),
        (CounterMetricFamily, "kvserve:tier_hits", "Chunk lookups a tier answered.", "hits"),
        (CounterMetricFamily, "kvserve:tier_loads", "Chunks loaded from a tier into the hot pool.", "loads"),
        (
            CounterMetricFamily,
            "kvserve:tier_load_seconds",
            "Seconds spent loading chunks from a tier (divide by tier_loads for the mean).",
            "load_seconds_total",
        ),
        (
            CounterMetricFamily,
            "kvserve:tier_corruptions",
            "Damaged or foreign entries a tier detected and removed.",
            "corruptions",
        ),
        (
            CounterMetricFamily,
            "kvserve:tier_fallbacks",
            "Lookups or loads a tier could not serve (down, no room, unfit): computed instead.",
            "fallbacks",
        ),
        (CounterMetricFamily, "kvserve:tier_writes", "Chunks written to a tier.", "writes"),
        (CounterMetricFamily, "kvserve:tier_write_errors", "Writes to a tier that failed.", "write_errors"),
    ]
    for family, metric_name, doc, attr in families:
        metric = family(metric_name, doc, labels=["model_name", "tier"])
        for t in tiers:
            metric.add_metric([name, t.tier], float(getattr(t, attr)))
        yield metric


def _reuse_quality(name: str, reuse: ContentReuseStats) -> Iterator[Metric]:
    """Cost-aware plan decisions, the online audit's KL distribution per strategy, and the guard."""
    plans = CounterMetricFamily(
        "kvserve:reuse_plans",
        "Prompts with content matches by the cost-aware decision (taken, or declined and why).",
        labels=["model_name", "decision"],
    )
    for decision, count in reuse.plans.items():
        plans.add_metric([name, decision], float(count))
    yield plans
    kl = GaugeMetricFamily(
        "kvserve:audit_first_token_kl",
        "Audited first-token KL(full prefill || served), nats, by repair strategy (quantile 1 = max).",
        labels=["model_name", "strategy", "quantile"],
    )
    audits = CounterMetricFamily(
        "kvserve:audits",
        "Approximately reused prompts recomputed in full by the audit.",
        labels=["model_name", "strategy"],
    )
    agree = GaugeMetricFamily(
        "kvserve:audit_top1_agreement",
        "Share of audited prompts whose served first token's top-1 equals the full prefill's.",
        labels=["model_name", "strategy"],
    )
    mean_kl = GaugeMetricFamily(
        "kvserve:audit_mean_kl",
        "Audited KL(full prefill || served), nats, averaged along each request's served tokens (up to "
        "--audit-tokens), by repair strategy; quantiles over requests (1 = max).",
        labels=["model_name", "strategy", "quantile"],
    )
    greedy = GaugeMetricFamily(
        "kvserve:audit_greedy_agreement",
        "Share of audited served tokens that are the full prefill's greedy choice at their position.",
        labels=["model_name", "strategy"],
    )
    for strategy, a in reuse.audit.items():
        for q, value in (("0.5", a.kl_p50), ("0.95", a.kl_p95), ("1", a.kl_max)):
            kl.add_metric([name, strategy, q], value)
        for q, value in (("0.5", a.mean_kl_p50), ("0.95", a.mean_kl_p95), ("1", a.mean_kl_max)):
            mean_kl.add_metric([name, strategy, q], value)
        audits.add_metric([name, strategy], float(a.num_audited))
        agree.add_metric([name, strategy], a.top1_agreement)
        greedy.add_metric([name, strategy], a.greedy_agreement)
    yield from (kl, audits, agree, mean_kl, greedy)
    for metric_name, doc, value in (
        (
            "kvserve:audit_guard_fired",
            "Audits whose mean KL is over --audit-max-kl (their documents are guarded).",
            reuse.num_guard_fired,
        ),
        (
            "kvserve:audit_guard_skipped_matches",
            "Content matches skipped: their document is guarded.",
            reuse.num_guard_skips,
        ),
        (
            "kvserve:audits_dropped",
            "Audits not run (too many pending, or the recompute failed).",
            reuse.num_audits_dropped,
        ),
    ):
        c = CounterMetricFamily(metric_name, doc, labels=["model_name"])
        c.add_metric([name], float(value))
        yield c
