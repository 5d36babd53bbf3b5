"""GrammarWorker: compiles grammars on threads of its own, so neither the event loop nor the engine waits."""

from __future__ import annotations

import itertools
import os
import queue
import threading
from concurrent.futures import Future

from kvserve.errors import OverloadedError
from kvserve.request import StructuredOutput
from kvserve.structured.compiler import GrammarCompiler, grammar_key
from kvserve.structured.schema import SchemaProcess

_Key = tuple[str, str]
_Job = tuple[int, int, _Key | None, StructuredOutput | None, "Future[None] | None"]  # None: stop


class GrammarWorker:
    """Compiles a GrammarCompiler's grammars on `num_threads` daemon threads (default: 1 below 8
    cores, else 2), at most `max_pending` distinct grammars queued or compiling at once.

    `submit` returns None when the grammar is cached, else a Future that completes when it is (its
    exception: InvalidRequestError for a schema that does not compile). Identical schemas in flight
    share one compile. The shortest schema is compiled first (compile time grows with the schema),
    so a small schema waits at most for the compiles already running, not for a queue of large ones.
    Past `max_pending` distinct grammars `submit` raises OverloadedError (503, code
    grammar_queue_full) at once: a flood of large schemas is refused, not queued without bound.
    Each thread translates schemas to grammars in a SchemaProcess of its own (the Python part of a
    compile, which holds the GIL), and llguidance drops the GIL while it builds the grammar against
    the tokenizer (up to seconds for thousands of keys), so the event loop and the engine thread run
    on meanwhile.
    """

    def __init__(self, compiler: GrammarCompiler, num_threads: int | None = None, max_pending: int = 32):
        if num_threads is None:  # a compile takes a core: one where cores are few, two from 8 cores
            num_threads = 1 if (os.cpu_count() or 1) < 8 else 2
        self.compiler = compiler
        self.max_pending = max_pending
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO among schemas of one length; never compares the rest
        self._pending: dict[_Key, Future[None]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._run, args=(SchemaProcess(),), name=f"kvserve-grammar-{i}", daemon=True
            )
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, structured: StructuredOutput) -> Future[None] | None:
        if self.compiler.is_cached(structured):
            return None
        key = grammar_key(structured)
        with self._lock:
            if self._closed:
                raise OverloadedError(
                    "the server is shutting down; retry on another instance", code="shutting_down"
                )
            future = self._pending.get(key)
            if future is not None:
                return future
            if len(self._pending) >= self.max_pending:
                raise OverloadedError(
                    f"{self.max_pending} grammars are waiting to be compiled; retry shortly, or reuse "
                    "a schema already sent (compiled grammars are cached)",
                    code="grammar_queue_full",
                )
            future = Future()
            self._pending[key] = future
        self._queue.put((len(key[1]), next(self._order), key, structured, future))
        return future

    def shutdown(self) -> None:
        """Cancel the queued compiles and stop the threads (a compile that runs finishes first)."""
        with self._lock:
            self._closed = True
            for future in self._pending.values():
                future.cancel()  # a running one is not cancelled: it completes
        for _ in self._threads:
            self._queue.put((-1, next(self._order), None, None, None))

    def _run(self, schemas: SchemaProcess) -> None:
        while True:
            _, _, key, structured, future = self._queue.get()
            if key is None or structured is None or future is None:
                schemas.close()
                return
            error: BaseException | None = None
            if future.set_running_or_notify_cancel():
                try:
                    self.compiler.check(structured, schemas.grammar_of)
                except BaseException as e:
                    error = e
            with self._lock:  # before its waiters wake: they may submit the same schema again
                self._pending.pop(key, None)
            if future.running():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
