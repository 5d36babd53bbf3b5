"""GrammarWorker (issue 32.2): compiles off the calling thread, shares a compile between identical
schemas, compiles the shortest schema first, refuses past its bound, passes errors on, and cancels
what is queued at shutdown. A fake compiler whose compiles wait for the test to release them."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest

from kvserve.errors import InvalidRequestError, OverloadedError
from kvserve.request import StructuredOutput
from kvserve.structured.compiler import GrammarCompiler, grammar_key
from kvserve.structured.worker import GrammarWorker


class GatedCompiler:
    """Records what it compiles, in order; each compile waits until `release` (or `open`)."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.started = threading.Semaphore(0)
        self._gate = threading.Semaphore(0)
        self.threads: set[str] = set()

    def is_cached(self, structured: StructuredOutput) -> bool:
        return (structured.schema or "") in self.compiled

    def check(self, structured: StructuredOutput, translate: object = None) -> None:
        self.threads.add(threading.current_thread().name)
        self.started.release()
        assert self._gate.acquire(timeout=10)
        if structured.schema == "bad":
            raise InvalidRequestError("response_format: bad schema", param="response_format")
        self.compiled.append(structured.schema or "")

    def release(self, n: int = 1) -> None:
        self._gate.release(n)


def schema(text: str) -> StructuredOutput:
    return StructuredOutput("json_schema", text)


def worker(compiler: GatedCompiler, max_pending: int = 8) -> GrammarWorker:
    return GrammarWorker(compiler, num_threads=1, max_pending=max_pending)  # type: ignore[arg-type]


def wait(future: Future[None] | None) -> None:
    assert future is not None
    future.result(timeout=10)


def test_identical_schemas_share_a_compile_on_the_workers_thread_and_cached_ones_skip_it() -> None:
    compiler = GatedCompiler()
    w = worker(compiler)
    first, second = w.submit(schema('{"a":1}')), w.submit(schema('{"a":1}'))
    assert first is second and w.num_pending == 1
    compiler.release()
    wait(first)
    assert compiler.compiled == ['{"a":1}'] and compiler.threads == {"kvserve-grammar-0"}
    assert w.submit(schema('{"a":1}')) is None and w.num_pending == 0
    w.shutdown()


def test_the_shortest_schema_waiting_is_compiled_first() -> None:
    compiler = GatedCompiler()
    w = worker(compiler)
    running = w.submit(schema("x" * 50))
    assert compiler.started.acquire(timeout=10)  # the thread is busy with it
    queued = [w.submit(schema(text)) for text in ("y" * 900, "z" * 9, "w" * 90)]
    compiler.release(4)
    for future in [running, *queued]:
        wait(future)
    assert compiler.compiled == ["x" * 50, "z" * 9, "w" * 90, "y" * 900]
    w.shutdown()


def test_past_the_bound_a_new_schema_is_refused_with_a_503() -> None:
    compiler = GatedCompiler()
    w = worker(compiler, max_pending=2)
    futures = [w.submit(schema("a")), w.submit(schema("b"))]
    assert w.submit(schema("a")) is futures[0]  # sharing a compile needs no room
    with pytest.raises(OverloadedError) as err:
        w.submit(schema("c"))
    assert err.value.status == 503 and err.value.code == "grammar_queue_full"
    compiler.release(2)
    for future in futures:
        wait(future)
    compiler.release()
    wait(w.submit(schema("c")))  # room again
    w.shutdown()


def test_a_compile_error_reaches_every_waiter_and_is_not_cached() -> None:
    compiler = GatedCompiler()
    w = worker(compiler)
    one, two = w.submit(schema("bad")), w.submit(schema("bad"))
    compiler.release()
    for future in (one, two):
        assert future is not None
        with pytest.raises(InvalidRequestError, match="bad schema"):
            future.result(timeout=10)
    assert w.num_pending == 0 and not compiler.is_cached(schema("bad"))
    w.shutdown()


def test_shutdown_cancels_the_queued_compiles_and_refuses_new_ones() -> None:
    compiler = GatedCompiler()
    w = worker(compiler)
    running = w.submit(schema("a"))
    assert compiler.started.acquire(timeout=10)
    queued = w.submit(schema("b"))
    w.shutdown()
    compiler.release()
    wait(running)  # a compile that runs finishes
    assert queued is not None
    with pytest.raises(CancelledError):
        queued.result(timeout=10)
    with pytest.raises(OverloadedError) as err:  # nothing would compile it any more
        w.submit(schema("c"))
    assert err.value.code == "shutting_down"


def test_with_the_real_compiler_the_grammar_is_cached_for_the_engine(hf) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(hf, len(hf), [2])
    w = GrammarWorker(compiler)
    structured = StructuredOutput.of_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    wait(w.submit(structured))
    assert compiler.is_cached(structured) and grammar_key(structured) == ("json_schema", structured.schema)
    assert compiler.num_compiles == 1
    compiler.matcher(structured)  # what the engine thread does: no compile
    assert compiler.num_compiles == 1
    w.shutdown()


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from kvserve.models.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-random-llama"))
