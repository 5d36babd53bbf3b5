"""Slow senders cannot hold connections: uvicorn's HTTP protocols with a deadline on reading a request.

uvicorn has no header or body read timeout: a client that opens a connection and sends nothing, or
sends its request line, headers or body a byte at a time (slowloris), holds the connection for as long
as it likes, and enough of them fill `--max-connections` (uvicorn counts them) or the process's file
descriptors. `deadline_protocol` returns uvicorn's protocol (httptools where it is installed, as
uvicorn's "auto" picks, else h11) with a `ReadDeadline`: a request (line, headers and body) must arrive
whole within `--request-read-timeout-s` of its first byte, and a new connection must send one within
that long of opening, or the connection is closed. Idle kept-alive connections stay uvicorn's
(`--keep-alive-timeout-s`), and a response in progress (a stream) is never cut."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvserve")


class ReadDeadline:
    """One connection's timer. Its protocol arms it when the connection opens and when bytes of a
    request arrive, and disarms it once that request is whole. On expiry it closes the transport,
    unless a response is in progress on the connection (a pipelined request waits behind it, its
    reading paused): then it waits another `timeout_s`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        transport: asyncio.Transport,
        response_in_progress: Callable[[], bool],
    ):
        self.loop, self.timeout_s, self.transport = loop, timeout_s, transport
        self.response_in_progress = response_in_progress
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        """Start the clock, unless it runs already (a request's deadline counts from its first byte)."""
        if self._timer is None:
            self._timer = self.loop.call_later(self.timeout_s, self._expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.response_in_progress():
            self.arm()
            return
        log.debug("closed a connection whose request did not arrive within %.1f s", self.timeout_s)
        self.transport.close()


class H11DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a ReadDeadline (see the module docstring)."""

    read_timeout_s: ClassVar[float]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.deadline = ReadDeadline(self.loop, self.read_timeout_s, transport, self._responding)
        self.deadline.arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading():
            self.deadline.arm()
        else:
            self.deadline.disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # parses what was pipelined behind the response
        if self._reading() and not self.transport.is_closing():
            self.deadline.arm()

    def _reading(self) -> bool:
        """A request has begun and is not whole: its body is coming, or part of its head is buffered."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _responding(self) -> bool:
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete


def _httptools_protocol() -> type[asyncio.Protocol] | None:
    if importlib.util.find_spec("httptools") is None:
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsDeadlineProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a ReadDeadline (see the module docstring)."""

        read_timeout_s: ClassVar[float]

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.deadline = ReadDeadline(self.loop, self.read_timeout_s, transport, self._responding)
            self.deadline.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.deadline.disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:  # the request's first byte
            super().on_message_begin()
            self.deadline.arm()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.deadline.disarm()

        def _responding(self) -> bool:
            # a pipelined request queued behind the running one, or the running one's response started
            cycle = self.cycle
            started = cycle is not None and cycle.response_started and not cycle.response_complete
            return bool(self.pipeline) or started

    return HttpToolsDeadlineProtocol


HttpToolsDeadlineProtocol = _httptools_protocol()  # None without httptools


def deadline_protocol(read_timeout_s: float, http: str = "auto") -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn.Config(http=...): `http` "auto" (httptools where installed,
    else h11, as uvicorn picks), "httptools" or "h11", with a ReadDeadline of `read_timeout_s`."""
    base: Any = H11DeadlineProtocol
    if http != "h11" and HttpToolsDeadlineProtocol is not None:
        base = HttpToolsDeadlineProtocol
    elif http == "httptools":
        raise ValueError("httptools is not installed")
    return type(base.__name__, (base,), {"read_timeout_s": read_timeout_s})
