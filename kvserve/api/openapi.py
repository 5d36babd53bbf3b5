"""The OpenAPI document as the server really behaves: every route lists the error statuses it answers,
each with the OpenAI error envelope, no FastAPI 422s (validation errors are 400s), /metrics is
Prometheus text, streams are text/event-stream, and token ids are bounded by the served vocabulary.

The response models here document; the routes build their bodies in responses.py and stats.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from kvserve.api.middleware import OPEN_PATHS
from kvserve.api.strict import TOKEN_ID_MARK


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: the OpenAI envelope."""

    error: ErrorBody


class CachedDetails(_Open):
    cached_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedDetails


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(_Open):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class WarmResponse(BaseModel):
    num_tokens: int
    num_cacheable_tokens: int
    num_cached_tokens: int
    num_cached_chunks: int
    num_new_chunks: int
    pinned: bool


class UnpinResponse(BaseModel):
    num_tokens: int
    num_unpinned_chunks: int


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


class Stats(_Open):
    queue: dict[str, Any]
    cache: dict[str, Any]
    throughput: dict[str, Any]
    tokens: dict[str, Any]
    latency: dict[str, Any]
    model: dict[str, Any]
    weights: dict[str, Any]
    config: dict[str, Any]


_WHEN = {
    400: "Invalid or unsupported parameter (`param` names it), or a body that is not JSON.",
    401: "The server has an API key and the request did not send it.",
    404: "Unknown model.",
    413: "Request body over the size limit.",
    500: "Internal error (details in the server log).",
    503: "Too many requests in the system, the server is shutting down, or its engine is recovering from an "
    "internal error (Retry-After).",
    504: "The request ran past request_timeout_s.",
}


def responses(
    ok: type[BaseModel] | None, *errors: int, path: str = "", stream: bool = False, text: bool = False
) -> dict[int | str, dict[str, Any]]:
    """A route's documented responses: 200 (`ok`'s JSON, Prometheus text, or also an SSE stream),
    `errors`, and what every route can answer: 401 (except open paths) and 500."""
    out: dict[int | str, dict[str, Any]] = {}
    if text:
        out[200] = {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    elif ok is not None:
        out[200] = {"model": ok, "description": "OK"}
        if stream:  # (OpenAPI 3.1: the schema of each event) data: a chunk, an error envelope or [DONE]
            event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
            out[200]["content"] = {"text/event-stream": {"schema": event}}
    common = (500,) if path in OPEN_PATHS else (401, 500)
    for status in sorted({*errors, *common}):
        out[status] = {"model": ErrorResponse, "description": _WHEN[status]}
    return out


_BODIES: list[type[BaseModel]] = []  # bodies that routes parse themselves (json_body): their schemas


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that parses its own body (kvserve.api.errors.parse_body, off the event
    loop) instead of declaring it: the document shows `model` as the body all the same."""
    if model not in _BODIES:
        _BODIES.append(model)
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI, vocab_size: Callable[[], int], model_names: Sequence[str]) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in _BODIES], ref_template="#/components/schemas/{model}"
            )
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            app.openapi_schema = _corrected(doc, vocab_size(), list(dict.fromkeys(model_names)))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _corrected(doc: dict[str, Any], vocab_size: int, model_names: list[str]) -> dict[str, Any]:
    envelope = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for methods in doc.get("paths", {}).values():
        for op in methods.values():
            op.get("responses", {}).pop("422", None)
            for status, response in op.get("responses", {}).items():
                if status.startswith(("4", "5")):  # JSON even where the route's own class is text
                    response["content"] = envelope
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _bound_token_ids(doc, vocab_size)
    for schema in schemas.values():  # any other model is a 404
        model = schema.get("properties", {}).get("model")
        if model is not None and "anyOf" in model:
            model["anyOf"] = [{"type": "string", "enum": model_names}, {"type": "null"}]
    return doc


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, False):
            node.update(minimum=0, maximum=vocab_size - 1)
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)
