"""Counters and histograms behind /v1/stats and /metrics.

Latencies and token rates are observed from RequestOutputs on the engine's worker thread; cache and
queue facts come from the EngineStats snapshot the worker last published (`engine_stats`).
Prometheus names follow vLLM's where one exists (with the `kvserve:` prefix).

Every number here is declared in kvserve/stat_table.py: the engine's scalar numbers (`STATS`) and
labelled families (`FAMILIES`), which the collector below exports, and the numbers observed from
outputs (`OBSERVED`), whose histograms and counters are made from their declarations.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.engine.stats import EngineStats
from kvserve.request import RequestOutput
from kvserve.stat_table import FAMILIES, LATENCY_BUCKETS, OBSERVED, STATS

WINDOW_S = 60.0


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 131072):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.hist: dict[str, Histogram] = {}  # OBSERVED's histograms and counters, by key
        self.count: dict[str, Counter] = {}
        for o in OBSERVED:
            labels = ["model_name", *o.labels]
            if o.kind == "histogram":
                buckets = o.buckets(max_model_len)
                self.hist[o.key] = Histogram(o.prom, o.help, labels, buckets=buckets, registry=self.registry)
            else:
                self.count[o.key] = Counter(o.prom, o.help, labels, registry=self.registry)
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
                    self.hist["ttft"].labels(self.model_name).observe(ttft)
            elif num_new and last is not None:
                gap = (now - last) / num_new
                self._itl_s.append(gap)
                self.hist["itl"].labels(self.model_name).observe(gap)
            if num_new:
                self._last_token_time[out.request_id] = now
            self._events.append((now, num_prompt, num_new))
            self._trim(now)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
        if out.finished:
            reason = out.finish_reason.value if out.finish_reason else "error"
            self.count["finished"].labels(self.model_name, reason).inc()
            m = out.metrics
            if m.e2e_s is not None:
                self.hist["e2e"].labels(self.model_name).observe(m.e2e_s)
            if m.first_scheduled_time is not None:
                self.hist["queue_time"].labels(self.model_name).observe(
                    m.first_scheduled_time - m.arrival_time
                )
            self.hist["prompt_tokens"].labels(self.model_name).observe(out.num_prompt_tokens)

    def on_rejected(self) -> None:
        self.count["rejected"].labels(self.model_name).inc()

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
        for key, hist in (("ttft_s", self.hist["ttft"]), ("inter_token_s", self.hist["itl"])):
            cumulative = [
                int(sample.value)
                for family in hist.collect()
                for sample in family.samples
                if sample.name.endswith("_bucket") and sample.labels.get("model_name") == self.model_name
            ]
            counts = [b - a for a, b in itertools.pairwise([0, *cumulative])]
            out[key] = {
                "bounds": list(LATENCY_BUCKETS),
                "counts": counts or [0] * (len(LATENCY_BUCKETS) + 1),
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
    """Exposes the latest engine.stats() snapshot: every declared number and labelled family."""

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
        for declared in FAMILIES:
            if not declared.shown(s):
                continue
            family = GaugeMetricFamily if declared.kind == "gauge" else CounterMetricFamily
            metric = family(declared.prom, declared.help, labels=["model_name", *declared.labels])
            for labels, value in declared.samples(s):
                metric.add_metric([name, *labels], value)
            yield metric
