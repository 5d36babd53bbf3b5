"""Issue 62.5, "One client can take the whole server", against live tiny-random-llama servers: one
request may take at most --max-queue-share of the queue; slow senders are cut off at
--request-read-timeout-s while streams go on, and past --max-connections a request is refused at once;
/v1/stats' per-chunk rows are the admin key's, or nobody's once tenants use cache_salt."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop, wait_until

KEY, ADMIN = "user-key", "admin-key"
READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16
CHUNKED_PROMPT = list(range(1, 300))  # two whole 128-token chunks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = (
        *TINY_FLAGS,
        "--max-queue-size",
        "8",
        "--request-read-timeout-s",
        str(READ_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--admin-api-key",
        ADMIN,
    )
    s = launch(tmp_path_factory.mktemp("kvserve"), *flags, api_key=KEY)
    yield s
    stop(s)


def _stream_lines(server: Server, body: dict[str, object]) -> Iterator[str]:
    with server.http() as h, h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[6:]


# --- one request, half the queue ---------------------------------------------------------------------


def test_one_request_cannot_fill_the_queue(server: Server) -> None:
    """With --max-queue-size 8, n=8 filled the queue and every other client got 503; now a request
    may take half of it (the default --max-queue-share 0.5), and asking for more is a 400 naming the
    flag, never clamped."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="x", n=8, max_tokens=1)
    assert info.value.body["param"] == "n" and "--max-queue-share" in info.value.message  # type: ignore[index]
    # the most one request may take runs, a long time, and meanwhile another client is served
    long = {"model": TINY, "prompt": "go", "n": 4, "max_tokens": 3000, "ignore_eos": True}
    lines = _stream_lines(server, long)
    next(lines)  # admitted and generating
    try:
        assert server.stats()["queue"]["in_system"] == 4
        other = client.completions.create(model=TINY, prompt="y", max_tokens=2)
        assert other.choices[0].finish_reason == "length"
    finally:
        lines.close()  # the client goes away: its four requests are aborted
    assert wait_until(lambda: server.stats()["queue"]["in_system"] == 0)


# --- slow senders ---------------------------------------------------------------------------------------

HEAD = f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n".encode()
SLOW_KINDS = [  # what a slow sender sends at once, then what it drips a byte at a time
    (b"", b""),
    (b"", HEAD),
    (HEAD, b"Content-Type: application/json\r\nX-Slow: " + b"a" * 200),
    (HEAD + b"Content-Length: 200\r\n\r\n", b'{"prompt": "' + b"a" * 188),
]


def _closed(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _send(s: socket.socket, data: bytes) -> None:
    try:
        s.send(data)
    except (BlockingIOError, ConnectionError):
        pass


def test_slow_senders_are_cut_off_while_a_stream_goes_on(server: Server) -> None:
    """40 slowloris connections (silent, or dripping the request line, the headers or the body a byte
    every 0.1 s) used to stay open as long as they dripped, and with no connection limit kept adding
    up. Now past --max-connections a new request is refused at once (503), every slow sender is closed
    within --request-read-timeout-s, and then the server serves again; a stream that began before them
    went on throughout and ends cleanly."""
    events: list[tuple[float, str]] = []
    body = {"model": TINY, "prompt": "go", "max_tokens": 3500, "ignore_eos": True}
    stream = threading.Thread(
        target=lambda: events.extend((time.monotonic(), e) for e in _stream_lines(server, body))
    )
    stream.start()
    assert wait_until(lambda: len(events) >= 2, 30), "the stream did not start"
    opened = time.monotonic()
    slow = [
        socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))) for _ in range(40)
    ]
    for i, s in enumerate(slow):
        s.setblocking(False)
        _send(s, SLOW_KINDS[i % len(SLOW_KINDS)][0])
    try:
        refused = httpx.get(server.base_url + "/health", timeout=10)
        assert refused.status_code == 503, refused.text  # uvicorn's own plain-text 503
        closed_after: dict[int, float] = {}
        step = 0
        while len(closed_after) < len(slow) and time.monotonic() - opened < READ_TIMEOUT_S + 10:
            for i, s in enumerate(slow):
                drip = SLOW_KINDS[i % len(SLOW_KINDS)][1]
                if i not in closed_after:
                    if step < len(drip):
                        _send(s, drip[step : step + 1])
                    if _closed(s):
                        closed_after[i] = time.monotonic() - opened
            step += 1
            time.sleep(0.1)
    finally:
        for s in slow:
            s.close()
    assert len(closed_after) == len(slow), f"{len(slow) - len(closed_after)} slow senders still open"
    assert max(closed_after.values()) < READ_TIMEOUT_S + 3.0, sorted(closed_after.values())
    assert wait_until(lambda: httpx.get(server.base_url + "/health", timeout=10).status_code == 200)
    cut = opened + max(closed_after.values())
    assert stream.is_alive() or events[-1][0] > cut, "the stream ended before the slow senders were cut"
    stream.join(120)
    chunks = [json.loads(e) for _, e in events[:-1]]
    assert events[-1][1] == "[DONE]" and all("error" not in c for c in chunks), events[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert any(t > cut for t, _ in events) and any(t < opened for t, _ in events)


# --- the per-chunk rows of /v1/stats -----------------------------------------------------------------


def test_per_chunk_rows_need_the_admin_key(server: Server) -> None:
    """/v1/stats showed every tenant's prompt lengths, hit counts and idle times to any key holder."""
    server.client().completions.create(model=TINY, prompt=CHUNKED_PROMPT, max_tokens=1)
    user = server.stats()["cache"]
    assert user["top_chunks"] == [] and "--admin-api-key" in user["top_chunks_withheld"]
    admin = Server(server.base_url, server.proc, server.log_path, ADMIN)
    rows = admin.stats()
    assert rows["cache"]["top_chunks_withheld"] is None and rows["cache"]["top_chunks"]
    assert rows["config"]["admin_api_key"] == "***" and ADMIN not in json.dumps(rows)
    # the admin key is also an API key
    done = admin.client().completions.create(model=TINY, prompt="x", max_tokens=1)
    assert done.choices[0].finish_reason == "length"


def test_per_chunk_rows_are_withheld_once_tenants_use_cache_salt(tiny_server: Server) -> None:
    """Without an admin key the rows are shown, until a request uses cache_salt: then nobody sees them."""
    client = tiny_server.client()
    client.completions.create(model=TINY, prompt=CHUNKED_PROMPT, max_tokens=1)
    before = tiny_server.stats()["cache"]
    assert before["top_chunks"] and before["top_chunks_withheld"] is None
    client.completions.create(
        model=TINY, prompt=CHUNKED_PROMPT, max_tokens=1, extra_body={"cache_salt": "t1"}
    )
    after = tiny_server.stats()["cache"]
    assert after["top_chunks"] == [] and "cache_salt" in after["top_chunks_withheld"]
