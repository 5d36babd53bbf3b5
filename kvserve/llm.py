"""LLM: the offline Python API over the engine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from kvserve.config import ServeConfig, make_config
from kvserve.engine.engine import Engine
from kvserve.errors import InvalidRequestError
from kvserve.request import Request, RequestOutput, ReuseOptions, SamplingParams, WarmResult

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

    # --- prompts -----------------------------------------------------------------------------------
    def to_token_ids(self, prompt: PromptLike, add_generation_prompt: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
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
        request_ids: list[str] = []
        for prompt, params in zip(prompt_list, params_list):
            token_ids = self.to_token_ids(prompt)
            for i in range(params.n):
                sample_params = params
                if params.n > 1 and params.seed is not None:
                    sample_params = dataclasses.replace(params, seed=params.seed + i)
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(
                    Request(rid, list(token_ids), sample_params, cache_salt=cache_salt, reuse=reuse)
                )
                request_ids.append(rid)
        done = self._run(set(request_ids))
        return [done[rid] for rid in request_ids]

    def _run(self, request_ids: set[str]) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(request_ids):
            for out in self.engine.step():
                if out.finished and out.request_id in request_ids:
                    done[out.request_id] = out
        return done

    # --- cache control -----------------------------------------------------------------------------
    def warm(self, prompt: PromptLike, pin: bool = True, cache_salt: str | None = None) -> WarmResult:
        """Compute and cache the KV of `prompt` (chat messages render as a shared chat prefix)."""
        token_ids = self.to_token_ids(prompt, add_generation_prompt=False)
        rid = f"warm-{next(self._ids)}"
        request = Request(
            rid, list(token_ids), SamplingParams(max_tokens=1), cache_salt=cache_salt, warm_only=True, pin=pin
        )
        self.engine.add_request(request)
        out = self._run({rid})[rid]
        if out.error:
            raise InvalidRequestError(f"warm failed: {out.error}")
        return WarmResult.from_output(len(token_ids), out, self.config.chunk_size, pin)

    def unpin(self, prompt: PromptLike, cache_salt: str | None = None) -> int:
        return self.engine.unpin(self.to_token_ids(prompt, add_generation_prompt=False), cache_salt)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
