"""ASGI middleware at the edge: the request body size limit (413) and the API key check (401)."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.api.errors import error_body

MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/dashboard", "/dashboard/fields.json"})
# the dashboard's page, its static files and its list of declared numbers (names, units, help) carry
# no data (its numbers come from /v1/stats, which needs the key): a browser must be able to load them
# before it has the key to send
OPEN_PREFIXES = ("/dashboard/static/",)


async def _send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


class EdgeMiddleware:
    """Rejects bodies over `max_body_bytes` (by Content-Length, or while reading a chunked body)
    and, when `api_key` is set, requests without `Authorization: Bearer <api_key>` or the
    `admin_api_key` (except OPEN_PATHS)."""

    def __init__(
        self, app: ASGIApp, api_key: str = "", max_body_bytes: int = MAX_BODY_BYTES, admin_api_key: str = ""
    ):
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and not _open(scope.get("path", "")) and not self._authorized(headers):
            await _send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        if length is None and headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_limited(receive)
            if body is None:
                await self._too_large(send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        auth = headers.get("authorization", "")
        return bearer_is(auth, self.api_key) or bearer_is(auth, self.admin_api_key)

    async def _too_large(self, send: Send) -> None:
        await _send_error(send, 413, f"request body too large (limit {self.max_body_bytes} bytes)")

    async def _read_limited(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def bearer_is(authorization: str, key: str) -> bool:
    """Whether an Authorization header value is `Bearer <key>` (never for an empty key), in
    constant time."""
    scheme, _, token = authorization.partition(" ")
    return (
        bool(key) and scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    )


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _replay(body: bytes, receive_rest: Receive) -> Receive:
    """Hands the app the body already read, then the connection's own messages (disconnect)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive_rest()

    return receive
