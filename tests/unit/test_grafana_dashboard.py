"""configs/grafana/kvserve.json: an importable Grafana dashboard whose PromQL queries only metrics that
a real in-process kvserve app exports on GET /metrics, under their exposition names (`_total` on
counters, `_bucket`/`_sum`/`_count` on histograms)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvserve.api.backend import LocalBackend
from kvserve.api.server import create_app
from kvserve.config import ServeConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.kernels import cpu_ext
from kvserve.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvserve.json"
TINY = "tiny-random-llama"
DS_UID = "${DS_PROMETHEUS}"
SELECTOR = '{model_name=~"$model_name"}'
METRIC = re.compile(r"kvserve:[a-zA-Z0-9_:]+")
# --weight-precision other than dense needs the CPU extension; without it kvserve exports no weight_precision_*
NESTED_FP = not cpu_ext.unavailable_reason()
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset"}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def queried_metrics(dashboard: dict[str, Any]) -> set[str]:
    names = {name for _, expr in exprs(dashboard) for name in METRIC.findall(expr)}
    for variable in dashboard["templating"]["list"]:
        names.update(METRIC.findall(variable["definition"]))
    return names


def exported_names(exposition: str) -> set[str]:
    """Every series name the exposition declares: the samples' names, and for a family with no samples
    yet (a labelled counter never incremented) the names its TYPE implies."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def bare_identifiers(expr: str) -> list[str]:
    """Identifiers of `expr` outside strings, selectors, ranges, grouping lists and function names:
    the metric names it queries."""
    s = re.sub(r'"[^"]*"', "", expr)
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    s = re.sub(r"[a-zA-Z_][a-zA-Z0-9_]*\s*\(", "(", s)
    return [w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s) if w not in PROMQL_WORDS]


def balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for c in re.sub(r'"[^"]*"', '""', expr):
        if c in "([{":
            stack.append(c)
        elif c in pairs and (not stack or stack.pop() != pairs[c]):
            return False
    return not stack


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GET /metrics of the app `kvserve serve` builds (cli.serve), with a disk tier and NestedFP weights so
    that the tier and weight precision families exist, after one completion."""
    config = ServeConfig(
        model=TINY,
        device="cpu",
        max_cache_bytes=16_000_000,
        weight_precision="fp16" if NESTED_FP else "dense",
        kv_disk_dir=str(tmp_path_factory.mktemp("disk-tier")),
        kv_disk_bytes=50_000_000,
    )
    engine = Engine(config)
    metrics = Metrics(config.model, engine.info.max_model_len)
    async_engine = AsyncEngine(engine, config.max_queue_size, observer=metrics.observe)
    async_engine.start()
    app = create_app(config, LocalBackend(async_engine, metrics, config))
    with TestClient(app) as client:
        body = {"model": TINY, "prompt": "the cache " * 12, "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.get("/metrics")
    assert r.status_code == 200
    return r.text


def test_dashboard_is_an_importable_grafana_model() -> None:
    """__inputs declares the Prometheus datasource; a model_name variable; panels with unique ids, a
    title, a description, a gridPos inside the 24-column grid without overlaps, and targets with an expr
    on ${DS_PROMETHEUS}."""
    d = load_dashboard()
    assert d["schemaVersion"] >= 36 and d["title"] and d["uid"]
    (ds_input,) = d["__inputs"]
    assert (ds_input["name"], ds_input["type"], ds_input["pluginId"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )
    (variable,) = [v for v in d["templating"]["list"] if v["name"] == "model_name"]
    assert variable["datasource"]["uid"] == DS_UID
    assert variable["definition"] == "label_values(kvserve:num_requests_running, model_name)"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in d["panels"]:
        pos = panel["gridPos"]
        assert panel["title"] and pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        area = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area
    panels = query_panels(d)
    assert len(panels) >= 15
    for panel in panels:
        assert panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == DS_UID, panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["datasource"]["uid"] == DS_UID, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_promql_is_well_formed() -> None:
    """Balanced brackets; every metric is a kvserve: one under the model_name selector; rates over
    $__rate_interval; quantiles over bucket rates summed by le; the heatmap reads buckets as a heatmap."""
    d = load_dashboard()
    for title, expr in exprs(d):
        assert balanced(expr), (title, expr)
        names = bare_identifiers(expr)
        assert names and all(METRIC.fullmatch(n) for n in names), (title, names)
        assert len(METRIC.findall(expr)) == expr.count(SELECTOR), (title, expr)
        assert set(re.findall(r"\[([^\]]*)\]", expr)) <= {"$__rate_interval"}, (title, expr)
        if "histogram_quantile(" in expr:
            grouping = re.findall(r"sum by \(([^)]*)\) \(rate\(kvserve:\w+_bucket\{", expr)
            assert grouping and all("le" in g.replace(" ", "").split(",") for g in grouping), (title, expr)
    (heatmap,) = [p for p in query_panels(d) if p["type"] == "heatmap"]
    (target,) = heatmap["targets"]
    assert target["format"] == "heatmap" and "_bucket" in target["expr"] and "sum by (le)" in target["expr"]
    assert not balanced("sum by (le) (rate(x[5m])") and not balanced('f{a="("}]')
    assert bare_identifiers('sum by (le) (rate(up{job="x"}[1m]))') == ["up"]


def test_every_queried_metric_is_exported(exposition: str) -> None:
    """Each kvserve: name the dashboard queries, with its suffix, is in a real /metrics exposition."""
    exported = exported_names(exposition)
    assert "kvserve:no_such_metric" not in exported
    assert "kvserve:time_to_first_token_seconds" not in exported  # a histogram is queried by its series
    assert "kvserve:prefix_cache_hits" not in exported and "kvserve:prefix_cache_hits_total" in exported
    queried = queried_metrics(load_dashboard())
    assert {
        "kvserve:time_to_first_token_seconds_bucket",
        "kvserve:inter_token_latency_seconds_bucket",
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:prefix_cache_hits_total",
        "kvserve:tier_hits_total",
        "kvserve:weight_precision_requests_total",
    } <= queried
    missing = queried - exported
    if not NESTED_FP:
        missing = {n for n in missing if not n.startswith("kvserve:weight_precision")}
    assert not missing, sorted(missing)
