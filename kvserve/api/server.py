"""The FastAPI app: OpenAI routes, tokenizer routes, cache warming, stats, metrics and the dashboard.

The event loop only routes: tokenizing and chat templating run on a tokenizer thread, engine work on
the engine's worker thread, and /v1/stats and /metrics read the snapshot that worker published, so
/health and running streams never wait for a long prefill or a huge prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

import kvserve
from kvserve.api import responses as R
from kvserve.api.backend import Backend, OutputStream
from kvserve.api.errors import ErrorEnvelopeMiddleware, install_error_handlers
from kvserve.api.middleware import MAX_BODY_BYTES, EdgeMiddleware, bearer_is
from kvserve.api.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    Health,
    ModelList,
    Stats,
    TokenizeResponse,
    UnpinResponse,
    Version,
    WarmResponse,
    install_openapi,
    json_body,
    responses,
)
from kvserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WarmRequest,
)
from kvserve.api.state import ServerState
from kvserve.api.stats import chunk_rows_withheld, with_chunk_rows
from kvserve.api.streaming import sse_response, stream_events
from kvserve.api.tools import ToolCalling, tool_calling
from kvserve.config import ServeConfig
from kvserve.errors import OverloadedError
from kvserve.request import (
    Request,
    RequestOutput,
    SamplingParams,
    WarmResult,
    check_token_ids,
    sample_requests,
    warm_request,
)
from kvserve.stat_table import declared_fields

T = TypeVar("T")
log = logging.getLogger("kvserve")
DASHBOARD = Path(__file__).parent / "dashboard"  # GET /dashboard: the page, its script and uPlot
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (nobody receives it)


def create_app(config: ServeConfig, backend: Backend, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app over a started backend; the app's shutdown stops it."""
    state = ServerState(config, backend, config.served_model_name or config.model, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        backend.shutdown()
        state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        state.body_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    app.add_middleware(
        EdgeMiddleware,
        api_key=config.api_key,
        max_body_bytes=max_body_bytes,
        admin_api_key=config.admin_api_key,
    )
    app.add_middleware(ErrorEnvelopeMiddleware)
    _info_routes(app, state)
    _generation_routes(app, state)
    _cache_routes(app, state)
    _stats_routes(app, state)
    install_openapi(app, lambda: state.vocab_size, (state.model_name, config.model))
    return app


def _info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=None, responses=responses(Health, 503, path="/health"))
    async def health() -> dict[str, str]:
        recovering = state.backend.recovering()
        if recovering is not None:  # the engine rebuilds its state after a step that raised
            raise OverloadedError(recovering, code="recovering")
        return {"status": "ok"}

    @app.get("/version", response_model=None, responses=responses(Version))
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.get("/v1/models", response_model=None, responses=responses(ModelList))
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "kvserve",
            "root": state.config.model,
            "max_model_len": state.info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", response_model=None, responses=responses(TokenizeResponse, 400, 404, 413))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        body.check()
        if body.messages is not None:
            ids = await state.chat_ids(body.messages, body.add_generation_prompt)
        else:
            ids = await state.off_loop(state.tokenizer.encode_prompt, body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}

    @app.post("/detokenize", response_model=None, responses=responses(DetokenizeResponse, 400, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}


def _generation_routes(app: FastAPI, state: ServerState) -> None:
    errors = (400, 404, 413, 503, 504)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=responses(CompletionResponse, *errors, stream=True),
        openapi_extra=json_body(CompletionRequest),
    )
    async def completions(http: HTTPRequest) -> Response | dict[str, Any]:
        body = await state.body(http, CompletionRequest)
        state.check_model(body.model)
        params = await state.on_body_thread(body.to_sampling_params)
        raw = body.prompts()
        prompts, echo = await state.off_loop(_completion_prompts, state.tokenizer, raw, body.echo)
        # token ids (the prompts', logit_bias, stop_token_ids) are checked once, by the engine's
        # intake (Engine.check_request) when the job is submitted
        job, requests = _make_job("completion", state, prompts, params, body, echo, body.logprobs)
        return await _run(state, job, requests, body.stream, body.include_usage, http)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=responses(ChatCompletionResponse, *errors, stream=True),
        openapi_extra=json_body(ChatCompletionRequest),
    )
    async def chat(http: HTTPRequest) -> Response | dict[str, Any]:
        body = await state.body(http, ChatCompletionRequest)
        state.check_model(body.model)
        calling = tool_calling(body)
        prompt = await state.chat_ids(body.messages, True, body.tools or ())
        params = await state.on_body_thread(body.to_sampling_params, state.info.max_model_len - len(prompt))
        if calling is not None and calling.structured is not None:
            params = dataclasses.replace(params, structured=calling.structured)
        job, requests = _make_job("chat", state, [prompt], params, body, [""], params.logprobs, calling)
        return await _run(state, job, requests, body.stream, body.include_usage, http)


def _completion_prompts(
    tok: Any, raw: list[str | list[int]], echo: bool
) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and each prompt's text to echo ("" without echo)."""
    prompts = [tok.encode_prompt(p) if isinstance(p, str) else list(p) for p in raw]
    texts = [(p if isinstance(p, str) else tok.decode(p)) if echo else "" for p in raw]
    return prompts, texts


def _make_job(
    kind: Any,
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    body: Any,
    echo: list[str],
    logprobs: int | None,
    tool_calling: ToolCalling | None = None,
) -> tuple[R.Job, list[Request]]:
    """The job's choices and its engine Requests: n per prompt (kvserve.request.sample_requests)."""
    job_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    choices: list[R.Choice] = []
    requests: list[Request] = []
    for i, prompt in enumerate(prompts):
        for request in sample_requests(
            f"{job_id}-{i}", prompt, params, body.cache_salt, body.reuse_options()
        ):
            choices.append(R.Choice(len(choices), request.request_id, i, echo[i]))
            requests.append(request)
    job = R.Job(
        kind, state.model_name, prompts, choices, logprobs is not None, id=job_id, tool_calling=tool_calling
    )
    return job, requests


async def _run(
    state: ServerState,
    job: R.Job,
    requests: list[Request],
    stream: bool,
    include_usage: bool,
    http: HTTPRequest,
) -> Response | dict[str, Any]:
    outputs = await state.submit(requests)
    if stream:  # sse-starlette watches the connection and cancels the stream when the client leaves
        return sse_response(stream_events(job, state.tokenizer, outputs, include_usage))
    finals = await _unless_client_leaves(http, _collect(outputs))
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return R.full_response(job, state.tokenizer, finals)


async def _collect(outputs: OutputStream) -> dict[str, RequestOutput]:
    """Wait for every request's final output; the first failure raises (and aborts the rest)."""
    finals: dict[str, RequestOutput] = {}
    try:
        async for out in outputs:
            if out.finished:
                finals[out.request_id] = out
                R.raise_for_failure(out)
    finally:
        if not outputs.finished:
            outputs.abort("another choice failed or the client went away")
    return finals


async def _unless_client_leaves(http: HTTPRequest, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it when the client disconnects first (None then). Cancelling
    _collect aborts the engine requests before the next step."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its finally post the abort
    if task.cancelled():
        return None
    return task.result()


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body was read before the route ran)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _cache_routes(app: FastAPI, state: ServerState) -> None:
    async def warm_token_ids(body: WarmRequest) -> list[int]:
        state.check_model(body.model)
        body.check()
        if body.messages is not None:
            return await state.chat_ids(body.messages, add_generation_prompt=False)
        if body.text is not None:
            return await state.off_loop(state.tokenizer.encode_prompt, body.text)
        token_ids = list(body.prompt_token_ids or [])
        check_token_ids(token_ids, state.vocab_size, "prompt_token_ids")
        return token_ids

    @app.post("/v1/warm", response_model=None, responses=responses(WarmResponse, 400, 404, 413, 503, 504))
    async def warm(body: WarmRequest, http: HTTPRequest) -> Response | dict[str, Any]:
        token_ids = await warm_token_ids(body)
        request = warm_request(f"warm-{uuid.uuid4().hex}", token_ids, body.pin, body.cache_salt)
        finals = await _unless_client_leaves(http, _collect(await state.submit([request])))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        final = finals[request.request_id]
        if not await state.backend.flush_tiers():
            log.warning("/v1/warm: the KV tiers' writes did not finish in time")
        return dataclasses.asdict(
            WarmResult.from_output(len(token_ids), final, state.config.chunk_size, body.pin)
        )

    @app.delete("/v1/warm", response_model=None, responses=responses(UnpinResponse, 400, 404, 413, 503))
    async def unwarm(body: WarmRequest) -> dict[str, Any]:
        token_ids = await warm_token_ids(body)
        return {
            "num_tokens": len(token_ids),
            "num_unpinned_chunks": await state.backend.unpin(token_ids, body.cache_salt),
        }


def _stats_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/static", StaticFiles(directory=DASHBOARD), name="dashboard")

    @app.get("/dashboard/fields.json", include_in_schema=False)
    async def dashboard_fields() -> JSONResponse:
        return JSONResponse(declared_fields())

    @app.get("/v1/stats", response_model=None, responses=responses(Stats))
    async def stats(http: HTTPRequest) -> JSONResponse:
        is_admin = bearer_is(http.headers.get("authorization", ""), state.config.admin_api_key)
        withheld = chunk_rows_withheld(is_admin, bool(state.config.admin_api_key), state.salted)
        return JSONResponse(with_chunk_rows(await state.backend.stats(), withheld))

    @app.get(
        "/metrics",
        response_model=None,
        response_class=PlainTextResponse,
        responses=responses(None, text=True),
    )
    async def metrics() -> Response:
        return Response(
            await state.backend.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )
