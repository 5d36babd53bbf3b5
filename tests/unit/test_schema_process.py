"""SchemaProcess (issue 32.2): a schema's Python work in a process of its own. It answers as
grammar_of does in this process (grammars and 400s alike), survives its child's death, and holds
this process's GIL only to pass text, where grammar_of holds it for milliseconds at a time."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.request import StructuredOutput
from kvserve.structured.schema import SchemaProcess, grammar_of
from tests.e2e.test_grammar_compile import large_schema

BAD = {
    "not json": '{"type":',
    "endless": json.dumps({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
    "deep": '{"items":' * 5000 + "{}" + "}" * 5000,
}


@pytest.fixture(scope="module")
def process() -> Iterator[SchemaProcess]:
    p = SchemaProcess()
    yield p
    p.close()


def test_the_child_answers_as_this_process_does(process: SchemaProcess) -> None:
    for kind, schema in [("json_object", None), ("json_schema", json.dumps(large_schema("a", 50)))]:
        assert process.grammar_of(kind, schema, "response_format") == grammar_of(
            kind, schema, "response_format"
        )
    for name, schema in BAD.items():
        with pytest.raises(InvalidRequestError) as here:
            grammar_of("json_schema", schema, "tools")
        with pytest.raises(InvalidRequestError) as there:
            process.grammar_of("json_schema", schema, "tools")
        assert there.value.message == here.value.message and there.value.param == "tools", name


def test_a_killed_child_is_replaced_and_the_call_still_answered(process: SchemaProcess) -> None:
    schema = StructuredOutput.of_schema(large_schema("k", 20)).schema
    first = process.pid
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    assert process.grammar_of("json_schema", schema, "response_format") == grammar_of(
        "json_schema", schema, "response_format"
    )
    assert process.pid != first
    assert process.grammar_of("json_object", None, "response_format")  # the new child serves


def longest_wait(work: Callable[[], object]) -> float:
    """The longest this process's spinning thread went without the GIL while `work` ran."""
    gaps: list[float] = []
    done = threading.Event()

    def spin() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.0002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.05)
    work()
    time.sleep(0.02)
    done.set()
    spinner.join()
    return max(gaps)


def test_the_childs_work_does_not_hold_this_processs_gil(process: SchemaProcess) -> None:
    schemas = [json.dumps(large_schema(f"g{i}")) for i in range(3)]  # 2,000 properties, ~418 KB each
    here = longest_wait(lambda: [grammar_of("json_schema", s, "response_format") for s in schemas])
    # The shortest of three tries: the OS preempting the spinner on 2 busy cores only lengthens a gap
    # (CI once read 6.1 ms against 10.2 in one try), while a GIL the child's work held would show in
    # every try, since the work is the same each time.
    there = min(
        longest_wait(lambda: [process.grammar_of("json_schema", s, "response_format") for s in schemas])
        for _ in range(3)
    )
    print(
        f"\nlongest GIL wait of a spinning thread: in this process {here * 1000:.1f} ms, child {there * 1000:.1f} ms"
    )
    assert here > 0.004  # the work held it here (5-14 ms pieces measured), so the check below can fail
    assert there < here / 2


def test_of_schema_writes_what_json_dumps_means() -> None:
    for schema in [
        {"type": "number", "minimum": float("nan"), "maximum": float("inf"), "default": -float("inf")},
        {"const": 10**30, "title": "é ☃", "enum": [1e16, 1.5e-7, -0.0, None, True]},
        {"title": "\ud800"},  # a lone surrogate: pydantic_core refuses it, json.dumps writes it
    ]:
        text = StructuredOutput.of_schema(schema).schema
        assert text is not None and " " not in text.replace("é ☃", "")
        assert json.dumps(json.loads(text)) == json.dumps(schema)
