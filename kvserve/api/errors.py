"""One mapping from errors to the OpenAI envelope {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.errors import KVServeError

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


def validation_param_and_message(exc: RequestValidationError) -> tuple[str | None, str]:
    """The first validation error as (param, message): `param` is the dotted path inside the body."""
    errors = exc.errors()
    if not errors:
        return None, "invalid request body"
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return param, f"unsupported parameter: {param} (kvserve does not implement it)"
    if first.get("type") == "json_invalid":
        return None, "the request body is not valid JSON"
    if first.get("type") == "missing":
        return param, f"missing required parameter: {param}"
    return param, f"invalid value for {param}: {first.get('msg', 'invalid')}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVServeError)
    async def _kvserve(request: Request, exc: KVServeError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.error_type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = validation_param_and_message(exc)
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(f"no route {request.method} {request.url.path}", 404)
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "internal error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc
        )
        return error_response("internal server error", 500)
