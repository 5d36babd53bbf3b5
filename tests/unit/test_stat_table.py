"""Every number is declared once (kvserve.stat_table: STATS, FAMILIES, OBSERVED): /metrics exports each
declared family and nothing else, /v1/stats shows each declared path, the cluster merges each as
declared, and every number the dashboard reads from the cache, queue and tokens sections is declared."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM
from kvserve.cluster.stats import merge_declared
from kvserve.metrics import Metrics
from kvserve.stat_table import FAMILIES, OBSERVED, STATS, stat_sections

DASHBOARD_JS = Path(__file__).resolve().parents[2] / "kvserve" / "api" / "dashboard" / "dashboard.js"
# the cache section's structured parts (not numbers): built beside the declared ones (api/stats.py)
STRUCTURED = {
    "cache.occupancy_blocks",
    "cache.reuse",
    "cache.tiers",
    "cache.top_chunks",
    "cache.top_chunks_withheld",
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(model="tiny-random-llama", max_cache_bytes=8 << 20, chunk_size=16)
    llm.generate([list(range(1, 40))], None)
    return llm


def test_each_number_is_declared_once_and_well_formed():
    paths = [s.path for s in STATS if s.path]
    proms = [s.prom for s in STATS if s.prom]
    assert len(paths) == len(set(paths)) and len(proms) == len(set(proms))
    for stat in STATS:
        assert stat.kind in ("gauge", "counter") and stat.help.endswith(".")
        assert stat.path or stat.prom, stat
        assert stat.merge in ("sum", "first") or re.fullmatch(r"ratio:\w+/\w+", stat.merge), stat.merge


def test_metrics_and_stats_show_every_declared_number(llm: LLM):
    metrics = Metrics("m")
    s = llm.stats()
    metrics.engine_stats = s
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus_text().decode())}
    sections = stat_sections(s)
    for stat in STATS:
        value = stat.value(s)
        if stat.prom:
            family = families[stat.prom]  # the parser drops a counter's _total from the family name
            assert family.type == stat.kind
            assert family.samples[0].value == pytest.approx(float(value))
        if stat.path:
            section, key = stat.path.split(".")
            assert sections[section][key] == value
    assert (
        sections["cache"]["hit_tokens"] == s.num_hit_tokens and sections["queue"]["running"] == s.num_running
    )


def test_the_cluster_merges_as_declared():
    a = {"hit_tokens": 30, "query_tokens": 40, "blocks_used": 1, "blocks_total": 4, "codec": "bf16"}
    b = {"hit_tokens": 10, "query_tokens": 60, "blocks_used": 3, "blocks_total": 4, "codec": "bf16"}
    rows = [{**{k: 0 for k in (s.path.split(".")[1] for s in STATS if s.path)}, **r} for r in (a, b)]
    merged = merge_declared("cache", rows)
    assert merged["hit_tokens"] == 40 and merged["query_tokens"] == 100
    assert merged["hit_rate"] == pytest.approx(0.4) and merged["usage"] == pytest.approx(0.5)
    assert merged["codec"] == "bf16"


def test_the_dashboard_reads_only_declared_numbers():
    js = DASHBOARD_JS.read_text()
    read = {f"{sec}.{key}" for sec, key in re.findall(r"stats\.(cache|queue|tokens)\.(\w+)", js)}
    read |= {f"cache.{key}" for key in re.findall(r"\bc\.(\w+)", js)}  # `const c = stats.cache`
    assert "const c = stats.cache" in js and read, "the dashboard's reads were not found"
    declared = {s.path for s in STATS if s.path}
    assert read - STRUCTURED <= declared, read - STRUCTURED - declared


def test_metrics_exports_every_declared_family_and_nothing_else(llm: LLM):
    """With NestedFP's families shown too (a weights mode), /metrics holds exactly the declared families,
    each of its declared kind, labels and samples."""
    s = llm.stats()
    s = dataclasses.replace(s, weights=dataclasses.replace(s.weights, mode="fp16", requests={"fp16": 3}))
    metrics = Metrics("m")
    metrics.engine_stats = s
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus_text().decode())}
    declared = (
        {stat.prom for stat in STATS if stat.prom} | {f.prom for f in FAMILIES} | {o.prom for o in OBSERVED}
    )
    assert set(families) == declared, set(families) ^ declared
    proms = (
        [stat.prom for stat in STATS if stat.prom] + [f.prom for f in FAMILIES] + [o.prom for o in OBSERVED]
    )
    assert len(proms) == len(set(proms))
    for family in FAMILIES:
        assert family.kind in ("gauge", "counter") and family.help.endswith("."), family.prom
        got = families[family.prom]
        assert got.type == family.kind
        samples = {tuple(x.labels[k] for k in family.labels): x.value for x in got.samples}
        want = {labels: value for labels, value in family.samples(s)}
        assert samples == pytest.approx(want), family.prom
        assert all(set(x.labels) == {"model_name", *family.labels} for x in got.samples)
    requests = families["kvserve:weight_precision_requests"]
    assert {x.labels["precision"]: x.value for x in requests.samples} == {"fp16": 3.0, "fp8": 0.0}
    for o in OBSERVED:
        assert o.kind in ("histogram", "counter") and o.help.endswith("."), o.prom
        assert families[o.prom].type == o.kind


def test_families_shown_only_when_they_apply(llm: LLM):
    s = llm.stats()
    assert s.weights.mode is None
    metrics = Metrics("m")
    metrics.engine_stats = s
    names = {f.name for f in text_string_to_metric_families(metrics.prometheus_text().decode())}
    assert "kvserve:weight_bytes" in names and "kvserve:weight_precision_requests" not in names
    assert "kvserve:kv_cache_blocks" in names
