"""HTTP fuzzing with schemathesis against a live tiny-random-llama server's own /openapi.json.

Every operation gets schema-valid and schema-invalid requests (property-based, with the coverage
phase's boundary values); each answer must be no 5xx, a documented status and content type, a body
that conforms to the documented schema (so every error is an OpenAI envelope), and invalid data must
be rejected. Generation is reached: the document is constrained before fuzzing so that valid bodies
ask for at most 4 tokens (and n <= 2), and the number of 200s per operation is counted and checked.
Afterwards the server must be healthy: /health, then one real completion.

The default run uses a small example budget; `-m slow` runs the same fuzzing with many more."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import checks as st_checks

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop

MAX_NEW_TOKENS = 4
GENERATION = ("POST /v1/completions", "POST /v1/chat/completions")
OK_BY_OPERATION: Counter[str] = Counter()
CALLS_BY_OPERATION: Counter[str] = Counter()
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.response_headers_conformance,
    st_checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # a 128-token context bounds what a chat without max_tokens generates (the context left)
    s = launch(tmp_path_factory.mktemp("kvserve"), *TINY_FLAGS, "--max-model-len", "128")
    yield s
    stop(s)


def constrained(doc: dict[str, Any]) -> dict[str, Any]:
    """The server's document with generation kept small: max_tokens-like fields <= MAX_NEW_TOKENS,
    n <= 2. Only valid requests are drawn from it (invalid ones from the document itself, so that a
    value the server rightly accepts is never counted as an accepted invalid one)."""
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                for option in props[field].get("anyOf", [props[field]]):
                    if option.get("type") == "integer":
                        option["maximum"] = MAX_NEW_TOKENS
        props["n"]["maximum"] = 2
    # valid chats are plain turns: a drawn tool history or tool choice is almost never consistent
    # (tool_call_id on a tool message, a named choice among the tools), so bodies drawn with them are
    # 400s and generation is rarely reached. The invalid bodies still come from the full document.
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        chat.pop(field, None)
    message = schemas["ChatMessage"]
    for field in ("tool_calls", "tool_call_id", "name"):
        message["properties"].pop(field, None)
    message["properties"]["role"]["enum"].remove("tool")
    content = message["properties"]["content"]
    content["anyOf"] = [option for option in content["anyOf"] if option.get("type") != "null"]
    content.pop("default", None)
    message["required"] = sorted({*message.get("required", []), "content"})
    return doc


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server) -> tuple[Any, Any]:
    """(the document to draw valid requests from, the server's document for invalid ones)"""
    doc = httpx.get(fuzz_server.base_url + "/openapi.json", timeout=30).json()
    schemas = (schemathesis.openapi.from_dict(constrained(doc)), schemathesis.openapi.from_dict(doc))
    for schema in schemas:
        schema.config.update(base_url=fuzz_server.base_url, request_timeout=30)
    return schemas


# every documented operation (the first test checks this list against the document)
OPERATIONS = [
    "GET /health",
    "GET /version",
    "GET /v1/models",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/warm",
    "DELETE /v1/warm",
    "GET /v1/stats",
    "GET /metrics",
]
FUZZ_EXAMPLES = 60  # per operation, positive and negative mixed
SLOW_FUZZ_EXAMPLES = 500


def error_envelope(ctx: Any, response: Any, case: Any) -> None:
    """Every error answer is the OpenAI envelope."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body


def fuzz(schemas: tuple[Any, Any], operation: str, max_examples: int) -> None:
    method, path = operation.split()
    valid, invalid = (schema[path][method] for schema in schemas)
    strategy = st.one_of(
        valid.as_strategy(schemathesis.GenerationMode.POSITIVE),
        invalid.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )

    @given(case=strategy)
    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # no shrinking: a failure is reported as generated
    )
    def call(case: Any) -> None:
        response = case.call_and_validate(checks=CHECKS, additional_checks=[error_envelope])
        CALLS_BY_OPERATION[operation] += 1
        if response.status_code == 200:
            OK_BY_OPERATION[operation] += 1

    call()


def test_every_documented_operation_is_fuzzed(api_schema: tuple[Any, Any]) -> None:
    documented = [
        f"{method.upper()} {path}"
        for path, methods in api_schema[1].raw_schema["paths"].items()
        for method in methods
    ]
    assert sorted(documented) == sorted(OPERATIONS)


@pytest.mark.parametrize("operation", OPERATIONS)
def test_fuzz(api_schema: tuple[Any, Any], operation: str) -> None:
    fuzz(api_schema, operation, FUZZ_EXAMPLES)


def test_after_fuzzing_generation_was_reached_and_the_server_is_healthy(fuzz_server: Server) -> None:
    print(f"\nfuzzing: calls {dict(CALLS_BY_OPERATION)}\n200s {dict(OK_BY_OPERATION)}")
    for operation in GENERATION:
        assert OK_BY_OPERATION[operation] >= 3, (operation, dict(OK_BY_OPERATION))
    with fuzz_server.http() as h:
        assert h.get("/health").json() == {"status": "ok"}
    r = fuzz_server.client().completions.create(model=TINY, prompt="still alive", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    stats = fuzz_server.stats()
    assert stats["queue"]["in_system"] == 0 and stats["queue"]["errored"] == 0, stats["queue"]


@pytest.mark.slow
@pytest.mark.parametrize("operation", OPERATIONS)
def test_fuzz_slow(api_schema: tuple[Any, Any], operation: str) -> None:
    fuzz(api_schema, operation, SLOW_FUZZ_EXAMPLES)
