"""One mapping from errors to the OpenAI envelope {"error": {"message", "type", "param", "code"}}.

Internal errors are answered by ErrorEnvelopeMiddleware, not by an `Exception` handler: Starlette
hands such a handler to its outermost middleware, which re-raises after answering, and uvicorn then
closes the connection, so the client's next request on that keep-alive connection failed too."""

from __future__ import annotations

import email.message
import json
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.api.protocol import FIELD_NAMES, FORMS
from kvserve.api.strict import SURROGATE_FREE, no_surrogates
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.request import RANGES

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("kvserve.api")

RETRY_AFTER_S = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
    504: "timeout_error",
}


def error_body(
    message: str,
    status: int,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type or _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    message: str,
    status: int,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(
        error_body(message, status, error_type, param, code), status_code=status, headers=headers
    )


def kvserve_error_body(exc: KVServeError) -> dict[str, Any]:
    return error_body(exc.message, exc.status, exc.error_type, exc.param, exc.code)


_RANGE_ERRORS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
)
_RANGE_OF = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


def _split(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """A pydantic location (after "body") as (dotted path of fields and indices, the union member it
    failed in). Union members appear in locations as type names ('str', 'list[int]'), not fields."""
    path = [str(loc[0])] if loc else []
    for part in loc[1:]:
        if isinstance(part, int) or part in FIELD_NAMES:
            path.append(str(part))
        else:
            return ".".join(path), str(part)
    return ".".join(path), None


def _in_body(error: Any) -> tuple[Any, ...]:
    loc = tuple(error.get("loc", ()))
    return loc[1:] if loc[:1] == ("body",) else loc


def validation_param_and_message(
    exc: RequestValidationError, expects: str = "a JSON object"
) -> tuple[str | None, str]:
    """The first validation error as (param, message): `param` is the dotted path inside the body;
    `expects` says what the route's body holds."""
    errors = exc.errors()
    if not errors:
        return None, "invalid request body"
    first = errors[0]
    kind = first.get("type")
    loc = _in_body(first)
    if kind == "json_invalid":
        return None, "the request body is not valid JSON"
    if not loc:
        if kind == "missing":
            return None, f"the request body is missing: send {expects}"
        return None, f"the request body must be {expects}"
    param, member = _split(loc)
    top = str(loc[0])
    if kind == "extra_forbidden":
        param = ".".join(str(p) for p in loc)
        return param, f"unsupported parameter: {param} (kvserve does not implement it)"
    if kind == "missing":
        return param, f"missing required parameter: {param}"
    if kind == "unicode_surrogate":
        return param, f"invalid value for {param}: {first.get('msg')}"
    ranged = _RANGE_OF.get(top, top)
    if kind in _RANGE_ERRORS and ranged in RANGES:
        return param, f"{top} must be a finite number in {RANGES[ranged]} (got {first.get('input')!r})"
    members = {m for p, m in (_split(_in_body(e)) for e in errors) if p == param and m}
    form = FORMS.get(param.split(".")[-1])
    if member and len(members) > 1 and form:  # failed every form of a union: say what they are
        return param, f"invalid value for {param}: expected {form}"
    return param, f"invalid value for {param}: {first.get('msg', 'invalid')}"


class BodyValidationError(RequestValidationError):
    """A body that parse_body could not make its model from: FastAPI's errors, and what the route's
    body holds (the route declares no body for FastAPI to read that from)."""

    def __init__(self, errors: Sequence[Any], expects: str):
        super().__init__(errors)
        self.expects = expects


def parse_body(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """`model` from a request body as FastAPI makes a declared body: JSON when the content type is a
    JSON one, else the bytes themselves (which a model refuses); an empty body is missing.
    Errors are FastAPI's, located under "body", so they become the same 400s; a body nested too
    deeply for Python's recursion limit (while parsed or validated) is a 400 that says so (FastAPI
    answers "There was an error parsing the body"). The server runs it off the event loop for
    bodies that can be large (ServerState.body)."""
    expects = str(getattr(model, "expects", "a JSON object"))
    data: Any = raw
    if not raw:
        raise BodyValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}], expects
        )
    if _json_content(content_type):
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            pos = getattr(exc, "pos", getattr(exc, "start", 0))
            error = {"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error", "input": {}}
            raise BodyValidationError([error], expects) from None
        except RecursionError:
            raise _too_deep() from None
    # a body that cannot hold a lone surrogate skips the validators' walk for one (4 ms for 400 KB)
    context = {SURROGATE_FREE: True} if data is not raw and no_surrogates(raw) else None
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise BodyValidationError(errors, expects) from None
    except RecursionError:  # a validator walking a deep list that json.loads could still read
        raise _too_deep() from None


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(
        "the request body is nested too deeply (JSON arrays or objects inside each other)"
    )


def _json_content(content_type: str | None) -> bool:
    """FastAPI's rule (strict content type, its default): application/json or application/*+json."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _expects(request: Request, exc: RequestValidationError) -> str:
    if isinstance(exc, BodyValidationError):
        return exc.expects
    body_field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body_field, "field_info", None), "annotation", None)
    return str(getattr(model, "expects", "a JSON object"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVServeError)
    async def _kvserve(request: Request, exc: KVServeError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.error_type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = validation_param_and_message(exc, _expects(request, exc))
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
            message = f"{request.method} is not allowed on {request.url.path}; use {headers['Allow']}"
        else:
            message = str(exc.detail)
        response = error_response(message, exc.status_code)
        response.headers.update(headers)
        return response


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on this path (Starlette's own Allow names one route's)."""
    methods: set[str] = set()
    for route in request.app.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


class ErrorEnvelopeMiddleware:
    """Answers an unhandled exception with the 500 envelope (no stack trace in the body; it goes to
    the log) and keeps the connection usable: the exception does not reach the server. If the
    response had started (a stream), it is ended where it was."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            log.error(
                "internal error on %s %s: %s",
                scope.get("method"),
                scope.get("path"),
                type(exc).__name__,
                exc_info=exc,
            )
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await error_response("internal server error", 500)(scope, receive, send)
