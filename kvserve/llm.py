"""LLM: the offline Python API over the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvserve.config import ServeConfig, make_config
from kvserve.engine.engine import Engine
from kvserve.engine.stats import EngineStats
from kvserve.errors import InvalidRequestError
from kvserve.request import (
    Request,
    RequestOutput,
    ReuseOptions,
    SamplingParams,
    WarmResult,
    sample_requests,
    warm_request,
)

Messages = list[dict[str, Any]]
PromptLike = str | list[int] | Messages


class LLM:
    """`LLM(model="smollm2-135m", max_cache_bytes=...)`; keyword arguments are ServeConfig fields."""

    def __init__(self, model: str | None = None, config: ServeConfig | str | None = None, **overrides: Any):
        if isinstance(config, ServeConfig):
            cfg = config.replace(**({"model": model} if model else {}), **overrides)
        else:
            cfg = make_config(config, model=model, **overrides)
        self.config = cfg
        self.engine = Engine(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Store the KV tiers' queued writes and stop their threads (which otherwise keep the engine
        and its pool alive). The LLM still answers, from its pool alone."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- prompts -----------------------------------------------------------------------------------
    def to_token_ids(self, prompt: PromptLike, add_generation_prompt: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt)
        raise InvalidRequestError("a prompt is a string, a list of token ids or a list of chat messages")

    def _normalize(self, prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
        if isinstance(prompts, str):
            return [prompts]
        if (
            isinstance(prompts, list)
            and prompts
            and (isinstance(prompts[0], int) or isinstance(prompts[0], dict))
        ):
            return [prompts]  # type: ignore[list-item]
        return list(prompts)  # type: ignore[arg-type]

    # --- generation --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        reuse: ReuseOptions | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt and sample (n > 1 gives n consecutive outputs)."""
        prompt_list = self._normalize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        requests: list[Request] = []
        if len(params_list) != len(prompt_list):
            raise InvalidRequestError(
                f"{len(prompt_list)} prompts but {len(params_list)} sampling params: give one, or one per prompt"
            )
        for prompt, params in zip(prompt_list, params_list, strict=True):
            token_ids = self.to_token_ids(prompt)
            requests += sample_requests(
                f"gen-{next(self._ids)}", token_ids, params, cache_salt, reuse, final_only=True
            )
        done = run_to_completion(self.engine, requests)
        return [done[r.request_id] for r in requests]

    # --- cache control -----------------------------------------------------------------------------
    def warm(self, prompt: PromptLike, pin: bool = True, cache_salt: str | None = None) -> WarmResult:
        """Compute and cache the KV of `prompt` (chat messages render as a shared chat prefix)."""
        token_ids = self.to_token_ids(prompt, add_generation_prompt=False)
        return warm(self.engine, f"warm-{next(self._ids)}", token_ids, pin, cache_salt)

    def unpin(self, prompt: PromptLike, cache_salt: str | None = None) -> int:
        return self.engine.unpin(self.to_token_ids(prompt, add_generation_prompt=False), cache_salt)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def run_to_completion(engine: Engine, requests: Sequence[Request]) -> dict[str, RequestOutput]:
    """Add `requests` (all or none: a refused one aborts those already added) and step the engine
    until each has its final output."""
    try:
        engine.add_requests(requests)
    except BaseException:
        while engine.has_unfinished_requests():  # flush the aborted ones' final outputs
            engine.step()
        raise
    added = {request.request_id for request in requests}
    done: dict[str, RequestOutput] = {}
    while len(done) < len(added):
        for out in engine.step():
            if out.finished and out.request_id in added:
                done[out.request_id] = out
    return done


def warm(
    engine: Engine, request_id: str, token_ids: Sequence[int], pin: bool = True, cache_salt: str | None = None
) -> WarmResult:
    """Compute, register and (if `pin`) pin the KV of `token_ids` by driving `engine` directly."""
    request = warm_request(request_id, token_ids, pin, cache_salt)
    out = run_to_completion(engine, [request])[request_id]
    if out.error:
        raise InvalidRequestError(f"warm failed: {out.error}")
    return WarmResult.from_output(len(token_ids), out, engine.config.chunk_size, pin)
