"""A real server with NestedFP weights (--weight-precision auto), through the OpenAI client: each
response's usage names the precision it was served at, /v1/stats and /metrics report the weights and
the requests by precision, warm and unpin work, and a repeated prompt hits the cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import TINY_FLAGS, Server, launch, stop


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = launch(
        tmp_path_factory.mktemp("kvserve-nested"),
        *TINY_FLAGS,
        "--weight-precision",
        "auto",
        "--chunk-size",
        "32",
    )
    yield s
    stop(s)


def test_usage_stats_and_metrics_report_the_precision(server: Server) -> None:
    client = server.client()
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    first = client.completions.create(model="tiny-random-llama", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny-random-llama", prompt=prompt, max_tokens=4, temperature=0)
    for r in (first, again):
        assert r.usage.model_extra["kvserve"]["weight_precision"] == {"fp16": 1}  # idle: fp16
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == first.choices[0].text
    weights = server.stats()["weights"]
    assert weights["precision"] == "auto" and weights["mode"] == "fp16"
    assert weights["requests"] == {"fp16": 2} and weights["generated_tokens"] == {"fp16": 8}
    assert 2.0 <= weights["bytes_per_param"] < 2.2
    with server.http() as h:
        text = h.get("/metrics").text
        assert (
            'kvserve:weight_precision_requests_total{model_name="tiny-random-llama",precision="fp16"} 2.0'
            in text
        )
        assert 'kvserve:weight_precision{model_name="tiny-random-llama",precision="fp8"} 0.0' in text
        warm = h.post("/v1/warm", json={"model": "tiny-random-llama", "text": prompt, "pin": True})
        assert warm.status_code == 200, warm.text
        unpin = h.request("DELETE", "/v1/warm", json={"model": "tiny-random-llama", "text": prompt})
        assert unpin.status_code == 200 and unpin.json()["num_unpinned_chunks"] > 0, unpin.text
