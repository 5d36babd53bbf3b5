"""Issue 11 at the HTTP edge, against a live tiny-random-llama server: inputs that used to fail every
request in flight or answer 500, type coercion, client disconnects, keep-alive after errors, and the
smaller defects (warm without a body, kv_cache_usage_perc, the queue-time and prompt-size histograms,
DELETE /v1/warm counts)."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import TINY, Server, wait_until

CHAT = [{"role": "user", "content": "hi"}]


def _body(route: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": TINY, "max_tokens": 2}
    base.update({"prompt": "hi"} if route == "/v1/completions" else {"messages": CHAT})
    base.update(extra)
    return base


def _post_raw(h: httpx.Client, route: str, body: dict[str, Any] | str) -> httpx.Response:
    """Posts the body as Python's json writes it (NaN and Infinity as bare tokens, as json.loads reads them)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return h.post(route, content=content.encode(), headers={"content-type": "application/json"})


def _param_of_400(r: httpx.Response) -> str | None:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error["param"]


def _local_port(r: httpx.Response) -> int:
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


ROUTES = ["/v1/completions", "/v1/chat/completions"]

# (extra body fields, the parameter the 400 must name)
OUTSIDE_THE_VOCABULARY = [
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),
]


class _Stream:
    """A long streamed completion running in a thread while other requests are made."""

    def __init__(self, server: Server, max_tokens: int = 60):
        self.body = {"model": TINY, "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True}
        self.events: list[str] = []
        self.error: BaseException | None = None
        self._server = server
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            with (
                self._server.http() as h,
                h.stream("POST", "/v1/completions", json={**self.body, "stream": True}) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except BaseException as e:  # reported by finish()
            self.error = e

    def __enter__(self) -> _Stream:
        self._thread.start()
        assert wait_until(lambda: len(self.events) >= 2, timeout_s=30), "the stream did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(60)

    def finished_cleanly(self) -> bool:
        self._thread.join(60)
        assert self.error is None, self.error
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert self.events[-1] == "[DONE]" and all("error" not in c for c in chunks), self.events[-3:]
        return chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- intake: token ids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_token_ids_outside_the_vocabulary_are_400s_and_do_not_touch_a_running_request(
    tiny_server: Server, route: str
) -> None:
    with _Stream(tiny_server) as stream, tiny_server.http() as h:
        for extra, param in OUTSIDE_THE_VOCABULARY:
            assert _param_of_400(h.post(route, json=_body(route, **extra))) == param, extra
    assert stream.finished_cleanly()


def test_prompt_and_detokenize_ids_outside_the_vocabulary_are_400s(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        assert (
            _param_of_400(h.post("/v1/completions", json=_body("/v1/completions", prompt=[1, -5])))
            == "prompt"
        )
        assert (
            _param_of_400(h.post("/v1/completions", json=_body("/v1/completions", prompt=[[1], [10**6]])))
            == "prompt"
        )
        assert _param_of_400(h.post("/detokenize", json={"tokens": [1, 10**6]})) == "tokens"
        assert _param_of_400(h.post("/v1/warm", json={"prompt_token_ids": [-1]})) == "prompt_token_ids"


# --- intake: values that pass validation and then break sampling or the server -------------------------
BREAKING_VALUES = [
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
]


@pytest.mark.parametrize("route", ROUTES)
def test_breaking_values_are_400s_on_a_kept_alive_connection(tiny_server: Server, route: str) -> None:
    """Each bad request is a 400 naming its parameter, and the next good request on the same
    connection succeeds (a 500 used to make the server reset the keep-alive connection)."""
    with _Stream(tiny_server) as stream, tiny_server.http() as h:
        first = h.post(route, json=_body(route))
        assert first.status_code == 200
        port = _local_port(first)
        for extra, param in BREAKING_VALUES:
            assert _param_of_400(_post_raw(h, route, _body(route, **extra))) == param, extra
            good = h.post(route, json=_body(route))
            assert good.status_code == 200 and _local_port(good) == port, extra
    assert stream.finished_cleanly()


def test_lone_surrogates_are_400s_naming_the_field(tiny_server: Server) -> None:
    # JSON "\ud800" decodes to a str that is not valid Unicode: no tokenizer or hash can take it
    with tiny_server.http() as h:
        cases = [
            ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
            ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
            ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "cache_salt": "\\ud800"}', "cache_salt"),
            ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "stop": ["\\ud800"]}', "stop"),
            ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
            ("/v1/warm", '{"text": "\\ud800"}', "text"),
        ]
        for route, body, param in cases:
            r = _post_raw(h, route, body)
            assert _param_of_400(r) == param, body
            assert "surrogate" in r.json()["error"]["message"]
        assert h.post("/v1/completions", json=_body("/v1/completions")).status_code == 200


def test_a_body_nested_50000_deep_is_a_400_on_every_json_route(tiny_server: Server) -> None:
    """Issue 62.4: json.loads' RecursionError escaped parse_body (the generation routes) as a 500."""
    nested = "[" * 50_000 + "]" * 50_000
    cases = [
        ("/v1/completions", '{"prompt": "x", "stop": %s}'),
        ("/v1/chat/completions", '{"messages": %s}'),
        ("/tokenize", '{"prompt": %s}'),
        ("/v1/warm", '{"text": %s}'),
    ]
    with tiny_server.http() as h:
        first = h.post("/v1/completions", json=_body("/v1/completions"))
        assert first.status_code == 200
        for route, body in cases:
            _param_of_400(_post_raw(h, route, body % nested))
        good = h.post("/v1/completions", json=_body("/v1/completions"))
        assert good.status_code == 200 and _local_port(good) == _local_port(first)


def test_a_tiny_positive_temperature_samples_and_hurts_nobody(tiny_server: Server) -> None:
    """vLLM's rule: a positive temperature below 0.01 is raised to 0.01 (logits / 1e-45 overflow)."""
    with _Stream(tiny_server) as stream, tiny_server.http() as h:
        for route in ROUTES:
            r = h.post(route, json=_body(route, temperature=1e-45, max_tokens=3, ignore_eos=True))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
    assert stream.finished_cleanly()


# --- intake: strict types and ranges -------------------------------------------------------------------
COERCED = [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"n": "2"}, "n"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"seed": "1"}, "seed"),
    ({"stop_token_ids": [True]}, "stop_token_ids.0"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
]
ABSURD = [
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"temperature": 1e308}, "temperature"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"presence_penalty": 1e30}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 10**20}, "n"),
    ({"recompute_tokens": 10**20}, "recompute_tokens"),
    ({"blend_check_layer": 10**20}, "blend_check_layer"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
]


@pytest.mark.parametrize("route", ROUTES)
def test_types_are_strict_and_numbers_have_ranges(tiny_server: Server, route: str) -> None:
    with tiny_server.http() as h:
        for extra, param in COERCED + ABSURD:
            r = h.post(route, json=_body(route, **extra))
            assert _param_of_400(r) == param, (extra, r.text)
        # the range is stated
        msg = h.post(route, json=_body(route, repetition_penalty=1e308)).json()["error"]["message"]
        assert "repetition_penalty" in msg and "100" in msg, msg


def test_completion_prompt_of_booleans_is_a_400(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        r = h.post("/v1/completions", json={"model": TINY, "prompt": [True, False], "max_tokens": 1})
        assert _param_of_400(r) == "prompt"
        assert "logprobs" == _param_of_400(
            h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": True})
        )
        assert "logprobs" == _param_of_400(
            h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "logprobs": 1})
        )


# --- disconnects ---------------------------------------------------------------------------------------
def test_a_non_streaming_client_that_goes_away_frees_its_work(tiny_server: Server) -> None:
    before = tiny_server.stats()
    body = {"model": TINY, "prompt": "go", "max_tokens": 3000, "ignore_eos": True}
    with tiny_server.http() as h, pytest.raises(httpx.ReadTimeout):
        # the client gives up after 1.5 s and closes its connection
        h.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    gone_at = time.monotonic()

    def freed() -> dict | None:
        s = tiny_server.stats()
        done = s["queue"]["running"] == 0 and s["queue"]["in_system"] == 0
        return s if done and s["cache"]["blocks_used"] == s["cache"]["cached_blocks"] else None

    after = wait_until(freed, timeout_s=2.0)
    assert after, f"still running 2 s after the client left: {tiny_server.stats()['queue']}"
    assert after["queue"]["aborted"] == before["queue"]["aborted"] + 1
    generated = after["tokens"]["generated_tokens"] - before["tokens"]["generated_tokens"]
    assert generated < 3000
    assert time.monotonic() - gone_at < 2.0


# --- smaller ones --------------------------------------------------------------------------------------
def test_warm_without_a_body_says_what_is_missing(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        for r in (h.post("/v1/warm"), h.post("/v1/warm", json={})):
            error = r.json()["error"]
            assert r.status_code == 400 and "None" not in error["message"], error
            assert "text" in error["message"] and "prompt_token_ids" in error["message"], error
        error = h.post("/v1/completions").json()["error"]
        assert "None" not in error["message"] and "body" in error["message"], error


def test_kv_cache_usage_counts_evictable_cached_blocks_as_free(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        usage_before = _metric(h.get("/metrics").text, "kvserve:kv_cache_usage_perc")
        blocks_before = tiny_server.stats()["cache"]["blocks_used"]
        doc = [1000 + i for i in range(512)]
        assert h.post("/v1/warm", json={"prompt_token_ids": doc, "pin": False}).status_code == 200
        stats = tiny_server.stats()
        assert stats["cache"]["blocks_used"] >= blocks_before + 512 // 16  # held by the cache...
        usage = _metric(h.get("/metrics").text, "kvserve:kv_cache_usage_perc")
        assert usage == pytest.approx(usage_before)  # ...but evictable: free for new work
        h.post("/v1/warm", json={"prompt_token_ids": doc, "pin": True})
        pinned = _metric(h.get("/metrics").text, "kvserve:kv_cache_usage_perc")
        assert pinned == pytest.approx(usage_before + 32 / stats["cache"]["blocks_total"])
        h.request("DELETE", "/v1/warm", json={"prompt_token_ids": doc})


def test_queue_time_and_prompt_tokens_histograms(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        text = h.get("/metrics").text
        count = _metric(text, "kvserve:request_prompt_tokens_count")
        total = _metric(text, "kvserve:request_prompt_tokens_sum")
        queued = _metric(text, "kvserve:request_queue_time_seconds_count")
        r = h.post("/v1/completions", json={"model": TINY, "prompt": [5, 6, 7, 8, 9], "max_tokens": 1})
        assert r.status_code == 200
        text = h.get("/metrics").text
    assert _metric(text, "kvserve:request_prompt_tokens_count") == count + 1
    assert _metric(text, "kvserve:request_prompt_tokens_sum") == total + 5
    assert _metric(text, "kvserve:request_queue_time_seconds_count") == queued + 1
    assert "kvserve:request_queue_time_seconds_bucket" in text


def test_unpin_reports_the_chunks_it_unpinned(tiny_server: Server) -> None:
    doc = [2000 + i for i in range(300)]
    with tiny_server.http() as h:
        assert h.post("/v1/warm", json={"prompt_token_ids": doc, "pin": True}).status_code == 200
        first = h.request("DELETE", "/v1/warm", json={"prompt_token_ids": doc}).json()
        second = h.request("DELETE", "/v1/warm", json={"prompt_token_ids": doc}).json()
        never = h.request("DELETE", "/v1/warm", json={"text": "never pinned, never warmed"}).json()
    assert first["num_unpinned_chunks"] == 3  # 2 chunks + the 44-token tail
    assert second["num_unpinned_chunks"] == 0
    assert never["num_unpinned_chunks"] == 0


# --- the API description -------------------------------------------------------------------------------
def test_openapi_documents_the_errors_the_server_answers(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        doc = h.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ErrorResponse" in schemas
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            assert "500" in responses and ("401" in responses) == (path != "/health"), (method, path)
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    assert response["content"]["application/json"]["schema"] == envelope, (
                        method,
                        path,
                        status,
                    )
            if method == "post":
                assert {"400", "413"} <= set(responses), (method, path)
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        ok = doc["paths"][route]["post"]["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        assert {"404", "503", "504"} <= set(doc["paths"][route]["post"]["responses"])


def test_405_names_the_allowed_methods_in_an_envelope(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        for method, path, allowed in (
            ("GET", "/v1/completions", {"POST"}),
            ("PUT", "/v1/warm", {"POST", "DELETE"}),
            ("POST", "/health", {"GET"}),
        ):
            r = h.request(method, path)
            assert r.status_code == 405, (method, path)
            assert {m.strip() for m in r.headers["allow"].split(",")} >= allowed, r.headers
            assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_redis_url_password_is_in_no_response_and_no_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 32.4: /v1/stats showed kv_redis_url with its password (the dashboard and cluster stats
    show the same config). The Redis here is unreachable: the tier is down, the server serves."""
    from tests.e2e.conftest import TINY_FLAGS, launch, stop

    server = launch(tmp_path, *TINY_FLAGS, "--kv-redis-url", "redis://:S3CRETPW@127.0.0.1:1/0", api_key="K3Y")
    try:
        with server.http() as h:
            r = h.post("/v1/completions", json={"model": TINY, "prompt": "hello there", "max_tokens": 2})
            assert r.status_code == 200
            stats = h.get("/v1/stats")
            metrics = h.get("/metrics")
        assert stats.status_code == 200 and "redis://:***@127.0.0.1:1/0" in stats.text
        for text in (stats.text, metrics.text, server.log()):
            assert "S3CRETPW" not in text and "K3Y" not in text
    finally:
        stop(server)
