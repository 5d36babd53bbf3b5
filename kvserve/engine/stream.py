"""The hand-offs between the engine's worker thread and asyncio (AsyncEngine): a submission's stream of
outputs, and the futures the worker settles from its thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvserve.errors import OverloadedError
from kvserve.request import RequestOutput

log = logging.getLogger("kvserve.async_engine")


class RequestStream:
    """The outputs of one submission (one or more Requests), in engine order.

    `async for out in stream` yields RequestOutput deltas and ends after every request finished."""

    def __init__(
        self,
        request_ids: list[str],
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[list[str], str], None],
    ):
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._loop = loop
        self._abort = abort  # AsyncEngine.abort

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def put_threadsafe(self, out: RequestOutput) -> None:
        call_soon(self._loop, self._queue.put_nowait, out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    def abort(self, reason: str = "aborted") -> None:
        """Abort the unfinished requests (non-blocking; takes effect before the next engine step)."""
        if self._unfinished:
            self._abort(list(self._unfinished), reason)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        log.debug("event loop closed; dropped a result")


def settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def settled(compiled: Future[None], loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    """An asyncio future that settles as `compiled` does (cancelled: the server is shutting down);
    cancelling it leaves `compiled` alone."""
    waiter: asyncio.Future[None] = loop.create_future()

    def done(f: Future[None]) -> None:
        shutting_down = OverloadedError(
            "the server is shutting down; retry on another instance", code="shutting_down"
        )
        call_soon(loop, settle, waiter, None, shutting_down if f.cancelled() else f.exception())

    compiled.add_done_callback(done)
    return waiter


def ignore(result: Any, error: BaseException | None) -> None:
    if error is not None:
        log.warning("engine command failed: %s", error)
