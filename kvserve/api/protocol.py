"""OpenAI request models and their conversion to SamplingParams.

Every model is strict (strict.py: types, ranges, unknown fields, lone surrogates). Token ids are
checked against the vocabulary once, by the engine's intake when a request is submitted
(engine/intake.py); the ids of /detokenize and of /v1/warm's prompt_token_ids by their routes, which
name their fields."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field

from kvserve.api.strict import Body, Strict, Text, TokenId, TokenIds, bounded, ranged
from kvserve.errors import InvalidRequestError
from kvserve.request import RANGES, REUSE_OPTION_NAMES, ReuseOptions, SamplingParams, StructuredOutput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# what a field with several accepted forms takes (validation errors quote it)
FORMS = {
    "prompt": "a non-empty string, or a non-empty list of strings, of token ids or of token-id lists",
    "stop": "a non-empty string or a list of up to 8 non-empty strings",
    "content": "a string or a list of text parts (null only in an assistant message with tool_calls)",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    """One turn. `content` may be null or absent only in an assistant message with `tool_calls`;
    a `tool` message answers the call named by `tool_call_id` (kvserve.api.tools.check_messages)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer renders as system
    content: str | list[TextPart] | None = Field(default=None, description=FORMS["content"])
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list):
            content = [p.model_dump() for p in content]
        out = {"role": self.role, "content": content}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments object (absent: no arguments)."
    )
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON schema of the output (absent: any object)."
    )
    strict: bool | None = None  # accepted; the output always follows the schema


class ResponseFormat(Strict):
    """OpenAI's response_format: text (free), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidRequestError(
                'response_format: type "json_schema" needs a json_schema object, and only it takes one',
                param="response_format",
            )
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if schema is None:
            return StructuredOutput("json_object")
        return StructuredOutput.of_schema(schema)


class _Sampling(Body):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = ranged("max_tokens", "Tokens to generate at most.")
    temperature: float | None = ranged("temperature", "0 = greedy; below 0.01 counts as 0.01.")
    top_p: float | None = ranged("top_p")
    top_k: int | None = ranged("top_k", "-1 or 0 = off.")
    min_p: float | None = ranged("min_p")
    n: int = ranged("n", "Samples per prompt.", default=1)
    stop: Text | Annotated[list[Text], Field(max_length=8)] | None = Field(
        default=None, description=FORMS["stop"]
    )
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = ranged("seed", "n > 1 samples use seed, seed+1, ...")
    presence_penalty: float | None = ranged("presence_penalty")
    frequency_penalty: float | None = ranged("frequency_penalty")
    repetition_penalty: float | None = ranged("repetition_penalty", "1 = off.")
    logit_bias: dict[str, Annotated[float, bounded("logit_bias")]] | None = Field(
        default=None, description=f"Token id (a decimal string) -> bias in {RANGES['logit_bias']}."
    )
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # kvserve extensions: opt in to content reuse (approximate) and tune its repair
    reuse: Literal["prefix", "any"] | None = None
    recompute_strategy: Literal["none", "selective", "cacheblend", "query"] | None = None
    recompute_tokens: int | None = ranged("recompute_tokens")
    recompute_ratio: float | None = ranged("recompute_ratio")
    blend_check_layer: int | None = ranged("blend_check_layer")
    blend_seam_tokens: int | None = ranged("blend_seam_tokens")
    audit: bool | None = Field(
        default=None,
        description="With approximate reuse: recompute the prompt in full when the server is idle and "
        "record the served first token's KL and top-1 agreement (/v1/stats content_reuse.audit).",
    )

    def reuse_options(self) -> ReuseOptions | None:
        values = {f: getattr(self, f) for f in REUSE_OPTION_NAMES}
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
            structured=self.response_format.structured() if self.response_format is not None else None,
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"-?[0-9]{1,30}", key):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids written as decimal strings (got {key!r})",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


class CompletionRequest(_Sampling):
    expects: ClassVar[str] = "a JSON object with prompt (and model, max_tokens, ...)"

    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description=FORMS["prompt"])
    logprobs: int | None = ranged(
        "logprobs",
        "Log probabilities of the chosen and the top alternative tokens (with echo, of the prompt's too).",
    )
    echo: bool = False
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        le=RANGES["max_tokens"].high,
        description=f"Tokens to generate at most (default {COMPLETIONS_DEFAULT_MAX_TOKENS}); 0 only with "
        f"echo=true: the prompt alone (with logprobs, scored). Range [0, {RANGES['max_tokens'].high}].",
    )

    def to_sampling_params(self) -> SamplingParams:
        """With echo, `logprobs` also scores the prompt (SamplingParams.prompt_logprobs) and
        max_tokens may be 0."""
        self.check_stream_options()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens must be at least 1; 0 (generate nothing) is allowed only with echo=true",
                param="max_tokens",
            )
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

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
    expects: ClassVar[str] = "a JSON object with messages (and model, max_tokens, ...)"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = ranged("max_tokens", "Tokens to generate at most.")
    logprobs: bool = False
    top_logprobs: int | None = ranged("logprobs", "Alternatives per token (with logprobs=true).")
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description=f"{FORMS['tool_choice']}; default auto with tools, none without (kvserve.api.tools).",
    )
    parallel_tool_calls: bool = True

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


class WarmRequest(Body):
    """Exactly one of text, prompt_token_ids or messages (rendered as a chat prefix)."""

    expects: ClassVar[str] = "a JSON object with exactly one of text, prompt_token_ids or messages"

    model: str | None = None
    text: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    pin: bool = True
    cache_salt: str | None = Field(default=None, min_length=1)

    def check(self) -> None:
        given = [k for k in ("text", "prompt_token_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequestError(
                f"give exactly one of text, prompt_token_ids or messages (got {', '.join(given) or 'none'})",
                param="text",
            )


class TokenizeRequest(Body):
    expects: ClassVar[str] = "a JSON object with exactly one of prompt or messages"

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(Body):
    expects: ClassVar[str] = "a JSON object with tokens (a list of token ids)"

    model: str | None = None
    tokens: list[TokenId]


REQUEST_MODELS: tuple[type[Strict], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    WarmRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
_ALL_MODELS: tuple[type[BaseModel], ...] = (
    *REQUEST_MODELS,
    ChatMessage,
    TextPart,
    StreamOptions,
    ResponseFormat,
    JsonSchemaFormat,
    ToolCall,
    FunctionCall,
    Tool,
    FunctionDefinition,
    NamedToolChoice,
    NamedFunction,
)
FIELD_NAMES = frozenset(name for model in _ALL_MODELS for name in model.model_fields)
