"""OpenAI request models (unknown fields are 400s that name them) and their conversion to
SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.errors import InvalidRequestError
from kvserve.request import ReuseOptions, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list):
            content = [p.model_dump() for p in content]
        return {"role": self.role, "content": content}


class _Sampling(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # kvserve extensions: opt in to approximate (position-independent) reuse and tune its repair
    reuse: Literal["prefix", "any"] | None = None
    recompute_strategy: Literal["none", "selective", "cacheblend"] | None = None
    recompute_tokens: int | None = Field(default=None, ge=0)
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    blend_check_layer: int | None = Field(default=None, ge=0)

    def reuse_options(self) -> ReuseOptions | None:
        fields = ("reuse", "recompute_strategy", "recompute_tokens", "recompute_ratio", "blend_check_layer")
        values = {f: getattr(self, f) for f in fields}
        return ReuseOptions(**values) if any(v is not None for v in values.values()) else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            n=self.n,
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (got {key!r})", param="logit_bias"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100] (got {value})", param="logit_bias"
            )
        out[token_id] = value
    return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError(
                "echo together with logprobs (prompt logprobs) is not supported", param="echo"
            )
        max_tokens = self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.sampling_params(max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def to_sampling_params(self, max_tokens_left: int) -> SamplingParams:
        """`max_tokens_left`: the context left after the prompt, the default length."""
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens or max(1, max_tokens_left)
        return self.sampling_params(max_tokens, logprobs)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]


class WarmRequest(_Strict):
    """Exactly one of text, prompt_token_ids or messages (rendered as a chat prefix)."""

    model: str | None = None
    text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    pin: bool = True
    cache_salt: str | None = Field(default=None, min_length=1)

    def check(self) -> None:
        given = [k for k in ("text", "prompt_token_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequestError("give exactly one of text, prompt_token_ids or messages", param="text")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
