"""Issue 62.5: slow senders held connections for as long as they liked (uvicorn has no header or body
read timeout). kvserve.api.read_deadline's protocols, on real sockets, under both of uvicorn's HTTP
implementations: a request must arrive whole within the deadline, while responses in progress, idle
kept-alive connections and requests that arrive in pieces in time are left alone."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from kvserve.api.read_deadline import HttpToolsDeadlineProtocol, deadline_protocol
from tests.e2e.conftest import free_port, wait_until

DEADLINE_S = 0.5
STREAM_CHUNKS = 12  # 0.1 s apart: a response that outlasts the deadline twice over
HTTPS = [
    "h11",
    pytest.param(
        "httptools", marks=pytest.mark.skipif(HttpToolsDeadlineProtocol is None, reason="no httptools")
    ),
]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, then answers `ok <body length>`, or on /stream STREAM_CHUNKS chunks."""
    assert scope["type"] == "http"
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for i in range(STREAM_CHUNKS):
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
            await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": b"ok %d" % size})


@pytest.fixture(params=HTTPS)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="critical",
        lifespan="off",
        http=deadline_protocol(DEADLINE_S, request.param),
        timeout_keep_alive=3,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 20)
    yield port
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server closed the connection (what it sent before is read and dropped)."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _drip(s: socket.socket, data: bytes) -> None:
    try:
        s.send(data)
    except (BlockingIOError, ConnectionError):
        pass


def _response(s: socket.socket, request: bytes, timeout_s: float = 5.0) -> bytes:
    """Sends `request` and reads its response (chunked: uvicorn's, with no Content-Length) to its last
    chunk, or until the socket closes."""
    s.setblocking(True)
    s.settimeout(timeout_s)
    s.sendall(request)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.setblocking(False)
    return data


def _ends_ok(response: bytes, size: int) -> bool:
    return response.startswith(b"HTTP/1.1 200") and response.endswith(b"ok %d\r\n0\r\n\r\n" % size)


POST_HEAD = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
SLOW = {
    "silent": (b"", b""),
    "request line": (b"", b"POST /x HTTP/1.1\r\n"),
    "headers": (b"POST /x HTTP/1.1\r\n", b"Host: t\r\nX-Slow: " + b"a" * 100),
    "body": (POST_HEAD, b"b" * 100),
}


def test_slow_senders_are_cut_at_the_deadline(port: int) -> None:
    """Connections that send nothing, or their request line, headers or body a byte every 0.05 s,
    are closed within the deadline (counted from the connection's opening) plus scheduling slack,
    not before it; each would otherwise last as long as its sender drips."""
    opened = time.monotonic()
    slow = {name: _connect(port) for name in SLOW}
    for name, (head, _) in SLOW.items():
        _drip(slow[name], head)
    closed_after: dict[str, float] = {}
    step = 0
    while len(closed_after) < len(slow) and time.monotonic() - opened < 5 * DEADLINE_S + 2:
        for name, s in slow.items():
            if name in closed_after:
                continue
            drip = SLOW[name][1]
            if step < len(drip):
                _drip(s, drip[step : step + 1])
            if _closed(s):
                closed_after[name] = time.monotonic() - opened
        step += 1
        time.sleep(0.05)
    for s in slow.values():
        s.close()
    assert set(closed_after) == set(SLOW), f"still open: {set(SLOW) - set(closed_after)}"
    assert all(DEADLINE_S * 0.9 <= t < DEADLINE_S + 1.5 for t in closed_after.values()), closed_after


def test_a_request_that_arrives_in_pieces_in_time_is_served(port: int) -> None:
    s = _connect(port)
    for piece in (b"POST /x HTTP/1.1\r\nHo", b"st: t\r\nContent-Len", b"gth: 3\r\n\r\nab"):
        _drip(s, piece)
        time.sleep(0.1)
    assert _ends_ok(_response(s, b"c"), 3)
    s.close()


def test_a_stream_is_never_cut_and_an_idle_kept_alive_connection_stays(port: int) -> None:
    """A response that outlasts the deadline completes; the connection then idles past the deadline
    (within the keep-alive timeout) and serves another request."""
    s = _connect(port)
    streamed = _response(s, b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    assert b"chunk %d\n" % (STREAM_CHUNKS - 1) in streamed and _ends_ok(streamed, 0), streamed[-200:]
    time.sleep(2 * DEADLINE_S)
    assert not _closed(s)
    assert _ends_ok(_response(s, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"), 0)
    s.close()


def test_a_partial_request_pipelined_behind_a_stream_does_not_cut_it(port: int) -> None:
    """The next request's first bytes arrive while a stream is being answered: the stream completes
    (its deadline waits behind the response), and the partial request is cut after it."""
    s = _connect(port)
    streamed = _response(s, b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\nGET /x HT")
    assert b"chunk %d\n" % (STREAM_CHUNKS - 1) in streamed and _ends_ok(streamed, 0), streamed[-200:]
    ended = time.monotonic()
    assert wait_until(lambda: _closed(s), 3)
    assert time.monotonic() - ended < DEADLINE_S + 0.5  # by its deadline, not the 3 s keep-alive timeout
    s.close()
