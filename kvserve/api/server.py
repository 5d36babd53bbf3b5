"""The FastAPI app: OpenAI routes, tokenizer routes, cache warming, stats and metrics."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import kvserve
from kvserve.api import responses as R
from kvserve.api.errors import install_error_handlers
from kvserve.api.middleware import MAX_BODY_BYTES, EdgeMiddleware
from kvserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WarmRequest,
)
from kvserve.api.stats import stats_body
from kvserve.api.streaming import sse_response, stream_events
from kvserve.config import ServeConfig
from kvserve.engine.async_engine import AsyncEngine, RequestStream
from kvserve.errors import InvalidRequestError, ModelNotFoundError, OverloadedError
from kvserve.metrics import Metrics
from kvserve.request import Request, RequestOutput, SamplingParams, WarmResult


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncEngine
    metrics: Metrics
    model_name: str
    started: int

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def info(self) -> Any:
        return self.engine.engine.info

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def submit(self, requests: list[Request]) -> RequestStream:
        try:
            return await self.engine.submit(requests)
        except OverloadedError:
            self.metrics.on_rejected()
            raise


def create_app(
    config: ServeConfig, engine: AsyncEngine, metrics: Metrics, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The app over a started AsyncEngine; the app's shutdown stops the engine."""
    state = ServerState(config, engine, metrics, config.served_model_name or config.model, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, api_key=config.api_key, max_body_bytes=max_body_bytes)
    _info_routes(app, state)
    _generation_routes(app, state)
    _cache_routes(app, state)
    _stats_routes(app, state)
    return app


def _info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.get("/v1/models")
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

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        body.check()
        tok = state.tokenizer
        if body.messages is not None:
            ids = tok.apply_chat_template([m.as_dict() for m in body.messages], body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        _check_token_ids(body.tokens, state.tokenizer.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}


def _check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param=param
        )


def _generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response | dict[str, Any]:
        state.check_model(body.model)
        params = body.to_sampling_params()
        tok = state.tokenizer
        raw = body.prompts()
        prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in raw]
        echo = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw]
        job, requests = _make_job("completion", state, prompts, params, body, echo, body.logprobs)
        return await _run(state, job, requests, body.stream, body.include_usage)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest) -> Response | dict[str, Any]:
        state.check_model(body.model)
        prompt = state.tokenizer.apply_chat_template(body.message_dicts(), add_generation_prompt=True)
        params = body.to_sampling_params(state.info.max_model_len - len(prompt))
        job, requests = _make_job("chat", state, [prompt], params, body, [""], params.logprobs)
        return await _run(state, job, requests, body.stream, body.include_usage)


def _make_job(
    kind: Any,
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    body: Any,
    echo: list[str],
    logprobs: int | None,
) -> tuple[R.Job, list[Request]]:
    """n engine Requests per prompt; seeded samples get seeds seed, seed+1, ..."""
    job_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    choices: list[R.Choice] = []
    requests: list[Request] = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            sample = params
            if params.seed is not None and params.n > 1:
                sample = dataclasses.replace(params, seed=params.seed + j)
            rid = f"{job_id}-{i}-{j}"
            choices.append(R.Choice(len(choices), rid, i, echo[i]))
            requests.append(
                Request(rid, list(prompt), sample, cache_salt=body.cache_salt, reuse=body.reuse_options())
            )
    job = R.Job(kind, state.model_name, prompts, choices, logprobs is not None, id=job_id)
    return job, requests


async def _run(
    state: ServerState, job: R.Job, requests: list[Request], stream: bool, include_usage: bool
) -> Response | dict[str, Any]:
    outputs = await state.submit(requests)
    if stream:
        return sse_response(stream_events(job, state.tokenizer, outputs, include_usage))
    finals = await _collect(outputs)
    return R.full_response(job, state.tokenizer, finals)


async def _collect(outputs: RequestStream) -> dict[str, RequestOutput]:
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


def _cache_routes(app: FastAPI, state: ServerState) -> None:
    def warm_token_ids(body: WarmRequest) -> list[int]:
        state.check_model(body.model)
        body.check()
        if body.messages is not None:
            return state.tokenizer.apply_chat_template([m.as_dict() for m in body.messages], False)
        if body.text is not None:
            return state.tokenizer.encode(body.text)
        return list(body.prompt_token_ids or [])

    @app.post("/v1/warm")
    async def warm(body: WarmRequest) -> dict[str, Any]:
        token_ids = warm_token_ids(body)
        request = Request(
            f"warm-{uuid.uuid4().hex}",
            list(token_ids),
            SamplingParams(max_tokens=1),
            cache_salt=body.cache_salt,
            warm_only=True,
            pin=body.pin,
        )
        final = (await _collect(await state.submit([request])))[request.request_id]
        result = WarmResult.from_output(len(token_ids), final, state.config.chunk_size, body.pin)
        return dataclasses.asdict(result)

    @app.delete("/v1/warm")
    async def unwarm(body: WarmRequest) -> dict[str, Any]:
        token_ids = warm_token_ids(body)
        return {
            "num_tokens": len(token_ids),
            "num_unpinned_chunks": await state.engine.unpin(token_ids, body.cache_salt),
        }


def _stats_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        snapshot = await state.engine.stats()
        state.metrics.engine_stats = snapshot
        body = stats_body(
            snapshot, state.engine.counters, state.metrics, state.config, state.info, state.model_name
        )
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.engine_stats = await state.engine.stats()
        return Response(
            state.metrics.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )
