"""parse_body (kvserve/api/errors.py), which the generation routes run off the event loop, answers
every body exactly as FastAPI's own parsing of a declared body does: the same status and the same
OpenAI error, for good bodies, bad JSON, wrong content types, missing bodies and bad fields; and a
body nested too deeply to parse is a 400 that says so."""

import asyncio
import json
import threading
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvserve.api.errors import install_error_handlers, parse_body
from kvserve.api.protocol import ChatCompletionRequest, CompletionRequest


def _apps(model: Any) -> tuple[TestClient, TestClient]:
    declared, parsed = FastAPI(), FastAPI()
    install_error_handlers(declared)
    install_error_handlers(parsed)

    @declared.post("/x")
    async def by_fastapi(body: model) -> dict[str, Any]:  # type: ignore[valid-type]
        return body.model_dump(exclude_none=True)

    @parsed.post("/x")
    async def by_parse_body(http: Request) -> dict[str, Any]:
        body = parse_body(await http.body(), http.headers.get("content-type"), model)
        return body.model_dump(exclude_none=True)

    return TestClient(declared), TestClient(parsed)


COMPLETION_BODIES: list[tuple[bytes, str | None]] = [
    (json.dumps({"prompt": "hi", "max_tokens": 3}).encode(), "application/json"),
    (json.dumps({"prompt": [1, 2, 3], "temperature": 0.5, "stop": ["a"]}).encode(), "application/json"),
    (json.dumps({"prompt": "hi", "bogus": 1}).encode(), "application/json"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), "application/json"),
    (json.dumps({"prompt": "hi", "max_tokens": "3"}).encode(), "application/json"),
    (json.dumps({"prompt": 3}).encode(), "application/json"),
    (json.dumps({}).encode(), "application/json"),
    (json.dumps([1, 2]).encode(), "application/json"),
    (b'{"prompt": "hi",', "application/json"),
    (b"\xff\xfe", "application/json"),
    (b'{"prompt": "hi"}', "text/plain"),
    (b'{"prompt": "hi"}', None),
    (b'{"prompt": "hi"}', "application/vnd.api+json"),
    (b"", "application/json"),
    (b'{"prompt": "\\ud800 lone"}', "application/json"),
    (b'{"prompt": "ok", "stop": ["\\uDC00"]}', "application/json"),
    (b'{"prompt": "\\ud83d\\ude00 a pair", "max_tokens": 1}', "application/json"),
    (
        '{"prompt": "caf\u00e9 \ud83d\ude00", "max_tokens": 1}'.encode("utf-8", "surrogatepass"),
        "application/json",
    ),
    ('{"prompt": "x", "stop": ["\ud800"]}'.encode("utf-8", "surrogatepass"), "application/json"),
    (b'{"prompt": "a literal \\\\ud800 is fine"}', "application/json"),
    (
        json.dumps(
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
            }
        ).encode(),
        "application/json",
    ),
]
CHAT_BODIES: list[tuple[bytes, str | None]] = [
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "application/json"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(), "application/json"),
    (json.dumps({"messages": []}).encode(), "application/json"),
    (json.dumps({"prompt": "hi"}).encode(), "application/json"),
    (b"", None),
]


@pytest.mark.parametrize(
    "model,bodies", [(CompletionRequest, COMPLETION_BODIES), (ChatCompletionRequest, CHAT_BODIES)]
)
def test_parse_body_answers_as_fastapi_does(model, bodies):
    declared, parsed = _apps(model)
    for raw, content_type in bodies:
        headers = {"content-type": content_type} if content_type else {}
        a = declared.post("/x", content=raw, headers=headers)
        b = parsed.post("/x", content=raw, headers=headers)
        assert (a.status_code, a.json()) == (b.status_code, b.json()), (raw[:80], content_type)
    assert any(
        declared.post("/x", content=r, headers={"content-type": "application/json"}).status_code == 200
        for r, _ in bodies
    )


def test_server_state_parses_bodies_on_the_body_thread(monkeypatch):
    """ServerState.body hands the bytes to parse_body on its own thread, never on the event loop's."""
    import kvserve.api.state as server

    seen: list[str] = []

    def recording(raw: bytes, content_type: str | None, model: Any) -> Any:
        seen.append(threading.current_thread().name)
        return parse_body(raw, content_type, model)

    monkeypatch.setattr(server, "parse_body", recording)
    state = server.ServerState.__new__(server.ServerState)
    state.body_thread = server.ThreadPoolExecutor(1, thread_name_prefix="kvserve-body")

    class Http:
        headers = {"content-type": "application/json"}

        async def body(self) -> bytes:
            return b'{"prompt": "hi"}'

    body = asyncio.run(state.body(Http(), CompletionRequest))  # type: ignore[arg-type]
    state.body_thread.shutdown()
    assert body.prompt == "hi"
    assert seen and seen[0].startswith("kvserve-body") and seen[0] != threading.main_thread().name


def test_no_surrogates_is_exact_where_it_says_true():
    """no_surrogates answers True only for ASCII bodies without a \\udXXX (D800-DFFF) escape: then no
    parsed string can hold a surrogate. Every other body is walked (False is always safe)."""
    from kvserve.api.strict import first_surrogate, no_surrogates

    cases = [b'{"a": "x"}', b'{"a": "\\u00e9"}', b'{"a": "\\ud800"}', b'{"a": "\\uDBFF\\uDFFF"}',
             b'{"a": ["\\\\ud800"]}', "{\"a\": \"\u00e9\"}".encode()]  # fmt: skip
    for raw in cases:
        if no_surrogates(raw):
            assert first_surrogate(json.loads(raw)) is None, raw
    assert no_surrogates(b'{"a": "x"}') and not no_surrogates(b'{"a": "\\ud800"}')


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_a_body_nested_too_deeply_is_a_400(model):
    """Issue 62.4: 50,000 nested lists made json.loads raise RecursionError, which escaped parse_body
    as a 500; a body json.loads can still read (990 deep) can recurse in the surrogate validator. Both
    are a 400 in the OpenAI shape. FastAPI's declared bodies (/v1/warm, /tokenize) answer 400 too."""
    declared, parsed = _apps(model)
    field = b'"prompt": "x", "stop": ' if model is CompletionRequest else b'"messages": '
    bodies = [b"[" * 50_000 + b"]" * 50_000, b"[" * 990 + b'"\\ud800"' + b"]" * 990]
    for nested in bodies:
        raw = b"{" + field + nested + b"}"
        r = parsed.post("/x", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (len(raw), r.status_code, r.text[:200])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
        assert "nested too deeply" in error["message"]
    r = declared.post(
        "/x", content=b"{" + field + bodies[0] + b"}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_json_reads_but_validation_recurses_on_is_a_400():
    """Just under json.loads' depth limit, a body with a surrogate escape recursed in the surrogate
    validator (it json.dumps the value): that RecursionError escaped too. Run on a fresh thread, as
    ServerState.body runs parse_body; each depth ends in a 400's error, never a RecursionError."""
    from kvserve.api.errors import BodyValidationError
    from kvserve.errors import InvalidRequestError

    outcomes: dict[int, tuple[bool, str]] = {}

    def run() -> None:
        for depth in range(900, 1001, 2):
            raw = b'{"prompt": "x", "stop": ' + b"[" * depth + b'"\\ud800"' + b"]" * depth + b"}"
            try:
                json.loads(raw)
                readable = True
            except RecursionError:
                readable = False
            try:
                parse_body(raw, "application/json", CompletionRequest)
                outcomes[depth] = (readable, "parsed")
            except InvalidRequestError:
                outcomes[depth] = (readable, "too deep")
            except BodyValidationError:
                outcomes[depth] = (readable, "invalid")
            except RecursionError:
                outcomes[depth] = (readable, "RecursionError")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(outcomes) == 51 and "RecursionError" not in {o for _, o in outcomes.values()}, outcomes
    assert (True, "too deep") in outcomes.values(), outcomes  # json.loads read it; validation recursed
