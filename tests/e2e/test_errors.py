"""Every error code in the OpenAI envelope, against a server with a key, a small queue and a short
timeout (plus the 500 path in-process)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY, TINY_FLAGS, Server, launch, stop, wait_until

KEY = "test-secret"
TIMEOUT_S = 1.5
LONG = {"model": TINY, "prompt": "go", "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = (*TINY_FLAGS, "--max-queue-size", "2", "--request-timeout-s", str(TIMEOUT_S))
    s = launch(tmp_path_factory.mktemp("kvserve"), *flags, api_key=KEY)
    yield s
    stop(s)


def _envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_401_without_or_with_a_wrong_key_and_health_stays_open(server: Server) -> None:
    with httpx.Client(base_url=server.base_url) as h:
        assert h.get("/health").status_code == 200
        assert _envelope(h.get("/v1/models"), 401)["type"] == "authentication_error"
        _envelope(
            h.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401
        )
        _envelope(h.get("/v1/stats"), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client().models.list().data[0].id == TINY


def test_400_names_the_parameter(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="x", suffix="y")
    assert info.value.body["param"] == "suffix"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "bad name"}}],
        )
    assert info.value.body["param"] == "tools.0.function.name"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "x"}], tool_choice="required"
        )
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt=[7] * 5000, max_tokens=1)  # longer than the context
    assert info.value.body["param"] == "prompt" and "4096" in info.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY, messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc,list-item]
    assert info.value.body["param"] == "messages.0.role"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="x", n=3)  # more than --max-queue-size could ever admit
    assert info.value.body["param"] == "n"  # type: ignore[index]
    with server.http() as h:
        bad_json = h.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        _envelope(bad_json, 400)
        _envelope(h.post("/v1/warm", json={}), 400)


def test_404_unknown_model_and_route(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="gpt-5", prompt="x")
    assert info.value.body["param"] == "model"  # type: ignore[index]
    with server.http() as h:
        _envelope(h.get("/v1/nothing-here"), 404)


def test_413_body_too_large(server: Server) -> None:
    with server.http() as h:
        error = _envelope(h.post("/v1/completions", json={"model": TINY, "prompt": "x" * 5_000_000}), 413)
    assert "too large" in error["message"]


def test_504_past_the_timeout_frees_the_work(server: Server) -> None:
    with server.http() as h:
        error = _envelope(h.post("/v1/completions", json=LONG), 504)
        assert error["type"] == "timeout_error"
        r = h.post("/v1/completions", json={**LONG, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout_error"
    stats = server.stats()
    assert stats["queue"]["timed_out"] >= 2 and stats["queue"]["running"] == 0
    assert stats["cache"]["blocks_used"] == stats["cache"]["cached_blocks"]


def test_503_under_a_burst_with_retry_after(server: Server) -> None:
    async def burst() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=30) as h:
            return await asyncio.gather(*(h.post("/v1/completions", json=LONG) for _ in range(6)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(503) >= 4 and set(codes) <= {503, 504}, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] == "1" and _envelope(rejected, 503)["type"] == "server_error"
    stats = wait_until(lambda: (s := server.stats())["queue"]["in_system"] == 0 and s)
    assert stats and stats["queue"]["rejected"] >= 4


def test_500_is_an_envelope_and_the_connection_survives(tmp_path: object) -> None:
    """An internal error answers the envelope without a stack trace, and the client's next request
    on the same keep-alive connection succeeds (Starlette's outermost middleware re-raised the
    error after answering, and uvicorn then closed the connection)."""
    import threading

    import uvicorn

    from kvserve.api.server import create_app
    from kvserve.config import ServeConfig
    from tests.e2e.conftest import free_port

    class Idle:
        def shutdown(self) -> None:
            pass

        def recovering(self) -> None:
            return None

    app = create_app(ServeConfig(model=TINY), Idle())  # type: ignore[arg-type]

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    @app.get("/boom-stream")
    async def boom_stream() -> object:
        from kvserve.api.streaming import sse_response

        async def events() -> AsyncIterator[str]:
            yield "first"
            raise RuntimeError("secret internal detail")

        return sse_response(events())

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 20)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as h:
            r = h.get("/boom")
            error = _envelope(r, 500)
            assert error["message"] == "internal server error"
            assert "secret" not in r.text and "Traceback" not in r.text
            again = h.get("/health")
            assert again.status_code == 200
            # a stream that fails after it began ends where it was (no [DONE]), the connection stays
            cut = h.get("/boom-stream")
            assert cut.status_code == 200 and "data: first" in cut.text and "secret" not in cut.text
            last = h.get("/health")
            responses = (r, again, cut, last)
            ports = {x.extensions["network_stream"].get_extra_info("client_addr")[1] for x in responses}
            assert len(ports) == 1, "the connection was not kept alive"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_request_that_could_never_run_is_a_400_even_when_the_queue_is_full(server: Server) -> None:
    """Validation comes before back-pressure: a full queue must not turn a 400 into a retryable 503."""

    async def full_then_invalid() -> tuple[list[httpx.Response], httpx.Response]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=30) as h:
            filling = [asyncio.create_task(h.post("/v1/completions", json=LONG)) for _ in range(2)]
            await asyncio.sleep(0.3)
            too_long = {"model": TINY, "prompt": [7] * 5000, "max_tokens": 1}  # longer than the context
            invalid = await h.post("/v1/completions", json=too_long)
            return list(await asyncio.gather(*filling)), invalid

    filled, invalid = asyncio.run(full_then_invalid())
    assert all(r.status_code == 504 for r in filled), [r.status_code for r in filled]
    assert _envelope(invalid, 400)["param"] == "prompt"
