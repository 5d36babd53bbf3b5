"""Grammar compiles never stall the server (issue 32.2), and a schema no finite document satisfies is
a 400 (issue 32.3).

While five distinct large json_schema requests compile, a running stream keeps getting its chunks
and /health answers: compiles run on the GrammarWorker's thread, the llguidance tokenizer was built
at start-up, and a request waits for its own grammar only. Before the fix each compile ran on the
event loop (~0.25 s per schema here, and the tokenizer's 0.4-0.9 s on the first) and every stream
stalled for all of them: 1.4 s.

measure_stall is also what scripts/bench_grammar_compile.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop

NUM_SCHEMAS = 5
NUM_PROPERTIES = 2000  # required, with descriptions: ~400 KB (the case), ~0.25 s to compile
# the target is 50 ms (a quiet machine); the test allows more for a shared, loaded 2-core machine,
# still far below one compile (before the fix the gap was every compile plus the tokenizer, > 1 s)
MAX_GAP_S = 0.3


def large_schema(salt: str, num_properties: int = NUM_PROPERTIES) -> dict[str, Any]:
    """An object of `num_properties` required string properties (names unique to `salt`, so every
    schema is compiled afresh). Required: llguidance refuses a first key among more than 500
    optional ones (its parser's row limit)."""
    described = {"type": "string", "description": "a field of a very large form " * 5}
    names = [f"{salt}_{i}" for i in range(num_properties)]
    return {"type": "object", "properties": dict.fromkeys(names, described), "required": names}


# The stream's reader runs in a process of its own and stamps each chunk there (CLOCK_MONOTONIC is one
# clock for every process), so the posting threads' work in this process (the GIL, building clients)
# does not show up as the server's gap.
STREAM_READER = """
import sys, time, httpx
url, body = sys.argv[1], sys.argv[2]
with httpx.stream("POST", url, content=body, headers={"content-type": "application/json"},
                  timeout=float(sys.argv[3])) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print(time.monotonic(), flush=True)
"""


def measure_stall(
    base_url: str,
    schemas: list[dict[str, Any]],
    stream_tokens: int = 4000,
    timeout_s: float = 120.0,
    isolated: bool = True,
) -> dict[str, Any]:
    """Stream a long completion; once it flows, first watch it alone for a second (quiet: the
    machine's own gaps), then the same number of plain completions (max_tokens 1, no schema) at once
    (small: what admitting that many requests costs the stream), then POST one json_schema completion
    (max_tokens 1) per schema at once and
    poll /health until they all answer; then the same again (the grammars are cached now: only the
    bodies are parsed), the control. For each round: the longest gap between the stream's chunks and
    the slowest /health in its window (seconds), the requests' statuses and seconds, and the chunks
    that arrived in the window. The bodies are encoded before a round starts, so the client's own
    JSON encoding is not timed.

    isolated (the default): the stream is read in a process of its own (STREAM_READER) and the
    requests share one HTTP client made before the round. Not isolated (how it was first measured):
    the stream is read on a thread beside the posting threads, and each post builds its own client
    (an SSL context: ~50 ms of this process's CPU on a 2-core machine)."""
    chunk_times: list[float] = []
    flowing, stop_stream = threading.Event(), threading.Event()
    body = {"model": TINY, "prompt": "go", "max_tokens": stream_tokens, "ignore_eos": True, "stream": True}

    def note(t: float) -> None:
        chunk_times.append(t)
        if len(chunk_times) == 20:
            flowing.set()

    def stream_here() -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=timeout_s) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    note(time.monotonic())
                if stop_stream.is_set():
                    return

    reader: subprocess.Popen[str] | None = None
    if isolated:
        reader = subprocess.Popen(
            [
                sys.executable,
                "-c",
                STREAM_READER,
                base_url + "/v1/completions",
                json.dumps(body),
                str(timeout_s),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        out = reader.stdout
        assert out is not None
        streamer = threading.Thread(target=lambda: [note(float(line)) for line in out])
    else:
        streamer = threading.Thread(target=stream_here)
    streamer.start()
    try:
        assert flowing.wait(timeout_s), "the stream did not start"
        rounds = {}
        for kind, batch in (("quiet", []), ("small", [None] * len(schemas)), ("compiling", schemas)):
            rounds[kind] = _round(base_url, batch, chunk_times, timeout_s, isolated)
        time.sleep(0.5)
        rounds["cached"] = _round(base_url, schemas, chunk_times, timeout_s, isolated)
        outlived = streamer.is_alive()
    finally:
        stop_stream.set()
        if reader is not None:
            reader.terminate()
            reader.wait(timeout_s)
        streamer.join(timeout_s)
    for result in rounds.values():
        result["stream_outlived_window"] = outlived
        result.update(_gaps(chunk_times, result.pop("start"), result.pop("end")))
    return rounds


def _round(
    base_url: str,
    schemas: list[dict[str, Any] | None],
    chunk_times: list[float],
    timeout_s: float,
    isolated: bool,
) -> dict[str, Any]:
    results: list[tuple[int, float, str]] = []
    shared = httpx.Client(base_url=base_url, timeout=timeout_s) if isolated else None

    def post(body: bytes) -> None:
        t0 = time.monotonic()
        headers = {"content-type": "application/json"}
        if shared is not None:
            r = shared.post("/v1/completions", content=body, headers=headers)
        else:
            r = httpx.post(base_url + "/v1/completions", content=body, headers=headers, timeout=timeout_s)
        results.append((r.status_code, time.monotonic() - t0, r.text[:300]))

    bodies = [
        json.dumps(
            {
                "model": TINY,
                "prompt": "A form:",
                "max_tokens": 1,
                **(
                    {"response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": s}}}
                    if s is not None
                    else {}
                ),
            }
        ).encode()
        for s in schemas
    ]
    posts = [threading.Thread(target=post, args=(b,)) for b in bodies]
    health: list[float] = []
    h = httpx.Client(base_url=base_url, timeout=timeout_s) if isolated else None
    start = time.monotonic()
    for t in posts:
        t.start()
    with h or httpx.Client(base_url=base_url, timeout=timeout_s) as h:
        quiet_until = start + 1.0 if not posts else 0.0  # no requests: watch the stream alone for a second
        while any(t.is_alive() for t in posts) or time.monotonic() < quiet_until:
            t0 = time.monotonic()
            h.get("/health").raise_for_status()
            health.append(time.monotonic() - t0)
            time.sleep(0.02)
    end = time.monotonic()
    for t in posts:
        t.join()
    if shared is not None:
        shared.close()
    return {
        "start": start,
        "end": end,
        "max_health_s": max(health, default=0.0),
        "statuses": [status for status, _, _ in results],
        "request_s": sorted(round(seconds, 3) for _, seconds, _ in results),
        "errors": [text for status, _, text in results if status != 200],
    }


def _gaps(chunk_times: list[float], start: float, end: float) -> dict[str, Any]:
    """The longest gap between chunks over [start, end] (the chunks just outside included)."""
    window = [t for t in chunk_times if start <= t <= end]
    edges = [t for t in chunk_times if t < start][-1:] + window + [t for t in chunk_times if t > end][:1]
    gaps = [b - a for a, b in zip(edges, edges[1:])]
    return {
        "window_s": end - start,
        "chunks_in_window": len(window),
        "max_gap_s": max(gaps, default=end - start),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = launch(tmp_path_factory.mktemp("kvserve"), *TINY_FLAGS)
    yield s
    stop(s)


def test_streams_and_health_flow_while_large_schemas_compile(server: Server) -> None:
    m = measure_stall(server.base_url, [large_schema(f"form{i}") for i in range(NUM_SCHEMAS)])
    compiling, cached = m["compiling"], m["cached"]
    print(f"\nwhile {NUM_SCHEMAS} large schemas compiled: {compiling}\nthe same, cached: {cached}")
    for r in (compiling, cached):
        assert r["statuses"] == [200] * NUM_SCHEMAS, r["errors"]
        assert r["stream_outlived_window"] and r["chunks_in_window"] >= 2, r  # it flowed through the window
    assert compiling["max_gap_s"] < MAX_GAP_S, f"the stream stalled {compiling['max_gap_s']:.3f} s"
    assert compiling["max_health_s"] < MAX_GAP_S, f"/health took {compiling['max_health_s']:.3f} s"


def test_the_start_up_heap_is_out_of_the_garbage_collectors_reach(server: Server) -> None:
    """A full collection walked the ~480,000 objects of the start-up (torch, transformers, the model):
    a 0.4 s pause of every stream and /health, set off in one round of the stall benchmark by five
    400 KB schemas parsed at once. The server freezes its start-up heap before serving."""
    process = httpx.get(server.base_url + "/v1/stats", timeout=30).json()["process"]
    assert process["gc_frozen_objects"] > 100_000, process
    assert len(process["gc_collections"]) == 3


# every document would contain itself: no finite one exists
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.mark.parametrize(
    "schema, chain",
    [
        (CYCLE, "# -> #/$defs/a -> #/$defs/b -> #/$defs/a"),
        (ENDLESS, "# -> #/properties/next -> #"),
    ],
    ids=["ref-cycle", "required-recursion"],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_a_schema_no_finite_document_satisfies_is_a_400(
    server: Server, schema: dict[str, Any], chain: str, endpoint: str
) -> None:
    body: dict[str, Any] = {
        "model": TINY,
        "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}},
    }
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with server.http() as h:
        r = h.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert "no finite JSON document satisfies the schema" in error["message"] and chain in error["message"]
