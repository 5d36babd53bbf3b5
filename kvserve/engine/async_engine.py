"""AsyncEngine: the asyncio facade over an Engine that runs on one worker thread.

Every engine call happens on the worker thread: the asyncio side posts commands to a thread-safe
queue and receives outputs through per-submission asyncio queues fed with call_soon_threadsafe.
A submitted request always ends with a finished output (invariant 5): on engine errors, on
shutdown and when its client goes away. A step that raises (a bug) fails every request in flight;
new submissions are refused (503, and /health answers 503) until the engine has checked its books and,
where they disagree, rebuilt its state (Engine.recover).

Readers of engine facts (/v1/stats, /metrics) never wait for a step: the worker publishes an
EngineStats snapshot after steps and commands, at most once per PUBLISH_EVERY_COST times the cost
of building one while the engine is busy, and always when it goes idle (so a client that got its
answer reads stats that include it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.engine import Engine
from kvserve.engine.stream import RequestStream, call_soon, ignore, settle, settled
from kvserve.errors import InvalidRequestError, OverloadedError
from kvserve.request import FinishReason, Request, RequestOutput
from kvserve.structured import GrammarWorker

log = logging.getLogger("kvserve.async_engine")

SHUTTING_DOWN = "server shutting down"  # RequestOutput.error of requests failed by drain()
INTERNAL_ERROR = "internal error"  # RequestOutput.error of requests failed by a step that raised
# why requests are refused (503, /health too) while the engine recovers from a step that raised, and
# after a recovery that failed
RECOVERING = "the engine is recovering from an internal error; retry shortly"
BROKEN = "the engine could not recover from an internal error; the server must be restarted"
PUBLISH_EVERY_COST = 20  # a busy worker spends at most 1/20 of its time publishing stats
# structured outputs' grammars compile on GrammarWorker's threads; past this many distinct grammars
# waiting, a request with a new one is refused (503 grammar_queue_full)
MAX_PENDING_GRAMMARS = 32

Command = Callable[[Engine], Any]
OutputObserver = Callable[[RequestOutput, float], None]


@dataclass
class QueueCounters:
    rejected: int = 0
    completed: int = 0  # finished with stop or length
    aborted: int = 0  # client gone or aborted
    timed_out: int = 0
    errored: int = 0


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_queue_size: int,
        observer: OutputObserver | None = None,
        max_queue_share: float = 1.0,
    ):
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.max_queue_share = max_queue_share
        # the most queue slots one submission (its n x prompts requests) may take; never below 1, so
        # that a request of one choice is never refused by it (1e-9: 0.29 x 100 is 28.999...)
        self.max_request_slots = max(1, math.floor(max_queue_size * max_queue_share + 1e-9))
        self.counters = QueueCounters()
        self._observer = observer
        self._commands: queue.SimpleQueue[tuple[Command, Callable[[Any, BaseException | None], None]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._num_in_system = 0  # requests admitted and not yet finished (any kind)
        self._routes: dict[str, RequestStream] = {}  # worker thread only
        self._stopping = False
        self._draining = False
        # why submissions are refused after a step raised (RECOVERING, BROKEN); None: the engine serves
        self.recovering: str | None = None
        self._thread: threading.Thread | None = None
        # replaced (never mutated) by the worker; built here while no worker runs
        self.snapshot = engine.stats()
        self._published_at = 0.0
        self._publish_cost_s = 0.0
        self.grammars = GrammarWorker(engine.grammars, max_pending=MAX_PENDING_GRAMMARS)

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.grammars.prepare()  # the llguidance tokenizer: not while a request waits
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self.grammars.shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)
        # the shutdown write reads the pool: only once no step can change it, and never a pool whose
        # books a failed recovery left disagreeing (what goes to disk must be exact)
        stopped = self._thread is None or not self._thread.is_alive()
        self.engine.close(write_hot=stopped and self.recovering != BROKEN)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503), give the ones in flight `grace_s` to finish, then finish the
        rest with the error SHUTTING_DOWN. Call before the HTTP server stops, so that every response
        completes (a clean error or a result) instead of being cancelled."""
        with self._lock:
            self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._num_in_system and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._num_in_system and self._thread is not None and self._thread.is_alive():
            await self.call(lambda engine: self._fail_all(SHUTTING_DOWN))

    @property
    def num_in_system(self) -> int:
        return self._num_in_system

    # --- asyncio side ------------------------------------------------------------------------------
    async def submit(self, requests: list[Request]) -> RequestStream:
        """Admit and queue `requests` together. Raises OverloadedError when the system is full and
        InvalidRequestError when the engine refuses one (then none of them runs). A request that could
        never run is a 400 even when the system is full. A structured output's grammar is compiled
        first, on GrammarWorker's threads: only this submission waits for it, and the engine thread
        finds it compiled."""
        for request in requests:
            self.engine.check_request(request)
        await self._compile_grammars(requests)
        self._reserve(len(requests))
        stream = RequestStream([r.request_id for r in requests], asyncio.get_running_loop(), self.abort)
        try:
            await self.call(lambda engine: self._add_all(engine, requests, stream))
        except asyncio.CancelledError:  # the add still runs on the worker: undo it there, in order
            stream.abort("client went away")
            raise
        return stream

    async def call(self, fn: Command) -> Any:
        """Run fn(engine) on the worker thread and return its result (or raise its exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            call_soon(loop, settle, future, result, error)

        self._post(fn, done)
        return await future

    def abort(self, request_ids: list[str], reason: str = "aborted") -> None:
        def run(engine: Engine) -> None:
            for rid in request_ids:
                engine.abort_request(rid, reason)

        self._post(run, ignore)

    async def unpin(self, token_ids: list[int], cache_salt: str | None) -> int:
        result: int = await self.call(lambda engine: engine.unpin(token_ids, cache_salt))
        return result

    # --- admission ---------------------------------------------------------------------------------
    async def _compile_grammars(self, requests: list[Request]) -> None:
        """Wait until every distinct grammar of `requests` is compiled. A client that leaves stops
        waiting but never cancels a compile (other requests may share it; the cache keeps it)."""
        loop = asyncio.get_running_loop()
        structured = {r.sampling_params.structured for r in requests if not r.warm_only}
        try:
            compiles = [self.grammars.submit(s) for s in structured if s is not None]
        except OverloadedError:
            with self._lock:
                self.counters.rejected += 1
            raise
        for compiled in compiles:
            if compiled is not None:  # None: cached
                await settled(compiled, loop)

    def _reserve(self, n: int) -> None:
        if n > self.max_request_slots:  # never admitted, however empty the queue: not an overload
            raise InvalidRequestError(
                f"n x prompts = {n} requests exceeds the {self.max_request_slots} queue slots one request "
                f"may take (max_queue_share {self.max_queue_share} of max_queue_size {self.max_queue_size}); "
                "ask for fewer choices or prompts, or raise --max-queue-share",
                param="n",
            )
        with self._lock:
            if self.recovering is not None:
                self.counters.rejected += 1
                raise OverloadedError(self.recovering, code="recovering")
            if self._stopping or self._draining:
                self.counters.rejected += 1
                raise OverloadedError(
                    "the server is shutting down; retry on another instance", code="shutting_down"
                )
            if self._num_in_system + n > self.max_queue_size:
                self.counters.rejected += 1
                raise OverloadedError(
                    f"the server is at capacity ({self.max_queue_size} requests in the system); retry shortly",
                    code="overloaded",
                )
            self._num_in_system += n

    def _release(self, n: int) -> None:
        with self._lock:
            self._num_in_system -= n

    def _add_all(self, engine: Engine, requests: list[Request], stream: RequestStream) -> None:
        """All or none (Engine.add_requests); on a refusal the queue slots are released too. The aborted
        ones' final outputs find no route and are dropped."""
        try:
            engine.add_requests(requests, checked=True)  # submit ran check_request
        except BaseException:
            self._release(len(requests))
            raise
        for request in requests:
            self._routes[request.request_id] = stream

    # --- worker thread -----------------------------------------------------------------------------
    def _post(self, fn: Command, done: Callable[[Any, BaseException | None], None]) -> None:
        if self._stopping and not (self._thread and self._thread.is_alive()):
            done(None, OverloadedError("the server is shutting down"))
            return
        self._commands.put((fn, done))
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            ran = self._run_commands()
            broken = self.recovering == BROKEN  # it steps no more: what was queued before fails
            if broken and self._routes:
                self._fail_all(BROKEN)
            if broken or not self.engine.has_unfinished_requests():
                if ran:
                    self._publish(force=True)
                if not self._wake.wait(self.engine.idle_wakeup_s) and not broken:
                    self._housekeeping()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine catches model errors: a bug (fail loudly, drop nothing)
                self._recover(e)
                continue
            self._publish(force=not self.engine.has_unfinished_requests())  # before clients hear
            self._dispatch(outputs)
            if not outputs:  # e.g. a batch window or a prefill slice: do not spin hot
                self._wake.wait(0.001)
        self._run_commands()
        self._fail_all(SHUTTING_DOWN)

    def _recover(self, exc: Exception) -> None:
        """A step raised. Submissions are refused (503, /health too) while every request in flight is
        failed (its client hears at once) and the engine checks its books, rebuilding its state where
        they disagree (Engine.recover); for good if the recovery itself fails (BROKEN)."""
        log.error("engine step failed; failing every request in flight", exc_info=exc)
        self.recovering = RECOVERING
        try:
            self.engine.fail_all(INTERNAL_ERROR)  # failed, not aborted: none of their KV is cached
            self._fail_all(INTERNAL_ERROR)  # the clients hear before a rebuild, not after
            self.engine.recover(exc)
            self.recovering = None
        except Exception:
            log.exception("the engine could not recover; refusing every request until a restart")
            self.recovering = BROKEN
        self._publish(force=True)

    def _housekeeping(self) -> None:
        try:
            self.engine.housekeeping()
        except Exception:  # a tier bug must not take the worker down
            log.exception("engine housekeeping failed")
        self._publish(force=True)

    def _run_commands(self) -> bool:
        """Runs the queued commands; whether there were any."""
        ran = False
        while True:
            try:
                fn, done = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                result = fn(self.engine)
            except BaseException as e:
                done(None, e)
            else:
                done(result, None)

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._published_at < PUBLISH_EVERY_COST * self._publish_cost_s:
            return
        try:
            snapshot = self.engine.stats()
        except Exception:  # stats must never take the worker down
            log.exception("building the engine stats failed")
            return
        self.snapshot = snapshot
        self._published_at = time.monotonic()
        self._publish_cost_s = self._published_at - now

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._routes.get(out.request_id)
            if stream is None:
                continue
            if self._observer is not None:
                try:
                    self._observer(out, now)
                except Exception:
                    log.exception("metrics observer failed")
            if out.finished:
                del self._routes[out.request_id]
                self._count_finished(out)
                self._release(1)
            stream.put_threadsafe(out)

    def _count_finished(self, out: RequestOutput) -> None:
        c = self.counters
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            c.completed += 1
        elif out.error == "timeout":
            c.timed_out += 1
        elif out.finish_reason == FinishReason.ABORT:
            c.aborted += 1
        else:
            c.errored += 1

    def _fail_all(self, reason: str) -> None:
        """Finish every routed request with an error; the engine's own final outputs for them
        (queued by abort_request) later find no route and are dropped."""
        for rid, stream in list(self._routes.items()):
            try:
                self.engine.abort_request(rid, reason)
            except Exception:
                log.exception("abort failed for a request")
            self._dispatch_failure(rid, stream, reason)

    def _dispatch_failure(self, rid: str, stream: RequestStream, reason: str) -> None:
        del self._routes[rid]
        self.counters.errored += 1
        self._release(1)
        out = RequestOutput(
            rid, [], [], "", [], "", finished=True, finish_reason=FinishReason.ERROR, error=reason
        )
        if self._observer is not None:  # the metrics see every request end (else they keep its id)
            try:
                self._observer(out, time.monotonic())
            except Exception:
                log.exception("metrics observer failed")
        stream.put_threadsafe(out)
