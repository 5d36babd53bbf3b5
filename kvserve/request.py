"""The plain values that cross layer boundaries: SamplingParams, Request (API -> engine) and
RequestOutput (engine -> API); the documented range of every numeric request parameter, the one
vocabulary check, and the two ways requests are made (n samples of a prompt, warming a prefix)."""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pydantic_core

from kvserve.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's floor for a positive temperature: logits / 1e-45 overflow float32 and sampling gets inf/nan
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class Range:
    """A numeric parameter's documented interval: [low, high], or (low, high] when `low_open`.
    NaN is in no range."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return bool(above and value <= self.high)

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low}, {self.high}]"

    def check(self, param: str, value: float) -> None:
        if value not in self:
            raise InvalidRequestError(f"{param} must be in {self} (got {value})", param=param)


# Every numeric parameter of /v1/completions and /v1/chat/completions, after OpenAI's ranges where
# OpenAI documents one (temperature's is [0, 2]; we allow vLLM's wider use), vLLM's otherwise, and
# otherwise a bound that keeps float32 sampling finite and integers inside int32 / int64.
RANGES: dict[str, Range] = {
    # more than the context left is clipped (finish reason length); SamplingParams also takes 0: a
    # prompt-only request (its prompt is computed and scored, nothing is generated)
    "max_tokens": Range(1, INT32_MAX),
    "temperature": Range(0.0, 100.0),  # 0 = greedy; (0, 0.01) is raised to 0.01 as vLLM does
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, INT32_MAX),  # -1 or 0 = off
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.01, 100.0),  # 1 = off; logits are divided or multiplied by it
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "logit_bias": Range(-100.0, 100.0),  # each value; each key a token id
    "seed": Range(INT64_MIN, INT64_MAX),
    "logprobs": Range(0, 20),
    "n": Range(1, 16),
    "recompute_tokens": Range(0, INT32_MAX),
    "recompute_ratio": Range(0.0, 1.0),
    "blend_check_layer": Range(0, INT32_MAX),
    "blend_seam_tokens": Range(0, INT32_MAX),
}


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """The one vocabulary check (prompts, /detokenize, logit_bias keys, stop_token_ids): raises
    InvalidRequestError naming `param` unless every id is in [0, vocab_size)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"{param}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param
        )


@dataclass(frozen=True)
class StructuredOutput:
    """Grammar-constrained decoding (kvserve/structured/): the generated text must be a JSON value
    (kind "json_object": any JSON object) or a JSON document matching `schema` (kind "json_schema";
    `schema` is the schema as compact JSON text with its keys in the order the client gave: a grammar
    generates properties in schema order, so sorting would reorder the output; equal texts share one
    compiled grammar). Generation ends when the grammar is complete."""

    kind: str  # "json_object" | "json_schema"
    schema: str | None = None
    source: str = "response_format"  # the request parameter it came from (errors name it), e.g. "tools"
    # a top-level array whose items should differ (tool_choice required): an item that repeats an
    # earlier one ends the generation (kvserve.structured.RepeatedItems)
    stop_on_repeated_item: bool = False

    @classmethod
    def of_schema(cls, schema: object, source: str = "response_format", **options: bool) -> StructuredOutput:
        """A json_schema output for `schema` (a parsed JSON schema), as the text described above.
        pydantic_core writes it (2 ms for 418 KB, json.dumps 6.5, both holding the GIL) with the same
        meaning (NaN and Infinity as json.dumps writes them, ints of any size); a lone surrogate,
        which it refuses, goes to json.dumps."""
        try:
            text = pydantic_core.to_json(schema).decode()
        except pydantic_core.PydanticSerializationError:
            text = json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", text, source, **options)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client gone, timeout or engine shutdown
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. `validate()` raises InvalidRequestError naming the field."""

    max_tokens: int = 16  # 0: compute the prompt only (for its prompt_logprobs or an echo), finish "length"
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0: chosen token's logprob plus top-k alternatives
    prompt_logprobs: int | None = None  # None = off; k >= 0: each prompt token's logprob plus top-k
    n: int = 1
    structured: StructuredOutput | None = None  # grammar-constrained output (None = free text)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self.validate()

    def validate(self) -> None:
        """Every value in its documented range (RANGES; max_tokens may also be 0, a prompt-only
        request); token ids are checked by check_vocab."""
        for name in _RANGED:
            RANGES[name].check(name, getattr(self, name))
        if self.max_tokens != 0:
            RANGES["max_tokens"].check("max_tokens", self.max_tokens)
        if self.seed is not None:
            RANGES["seed"].check("seed", self.seed)
        if self.logprobs is not None:
            RANGES["logprobs"].check("logprobs", self.logprobs)
        if self.prompt_logprobs is not None:
            RANGES["logprobs"].check("prompt_logprobs", self.prompt_logprobs)
        for value in (self.logit_bias or {}).values():
            RANGES["logit_bias"].check("logit_bias", value)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        if len(self.stop) > 8:
            raise InvalidRequestError(f"stop accepts at most 8 strings (got {len(self.stop)})", param="stop")

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias keys and stop_token_ids are token ids of this vocabulary."""
        check_token_ids(list(self.logit_bias or ()), vocab_size, "logit_bias")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")

    @property
    def penalizes_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_RANGED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
)


@dataclass(frozen=True)
class ReuseOptions:
    """Per-request opt-in to approximate (content) reuse and its repair; None = the server's setting."""

    reuse: str | None = None  # "prefix" (exact only) or "any"
    recompute_strategy: str | None = None  # none, selective, cacheblend, query
    recompute_tokens: int | None = None
    recompute_ratio: float | None = None
    blend_check_layer: int | None = None
    blend_seam_tokens: int | None = None
    audit: bool | None = None  # with reuse=any: recompute this prompt in full later, to measure the KL

    def __post_init__(self) -> None:
        if self.reuse not in (None, "prefix", "any"):
            raise InvalidRequestError(f"reuse must be 'prefix' or 'any' (got {self.reuse!r})", param="reuse")
        if self.recompute_strategy not in (None, "none", "selective", "cacheblend", "query"):
            raise InvalidRequestError(
                "recompute_strategy must be none, selective, cacheblend or query "
                f"(got {self.recompute_strategy!r})",
                param="recompute_strategy",
            )
        for name in ("recompute_tokens", "recompute_ratio", "blend_check_layer", "blend_seam_tokens"):
            value = getattr(self, name)
            if value is not None:
                RANGES[name].check(name, value)


# every ReuseOptions field: what a request body may carry (api/protocol.py); all but `reuse` act on
# approximate reuse only (reuse/build.py: check_reuse_request)
REUSE_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(ReuseOptions))


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class Request:
    """What the API hands the engine: one sequence to generate (n > 1 is n Requests)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    # warm-only requests compute (and register) the prompt's KV and generate nothing
    warm_only: bool = False
    pin: bool = False
    reuse: ReuseOptions | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # engine-internal (an audit's full recompute): scheduled only while no other request runs or
    # waits, and its output goes to the engine, never to a client
    background: bool = False
    # NestedFP weights: the precision to compute at (an audit keeps the audited request's); None: the
    # engine's policy picks (engine/precision.py)
    weight_precision: str | None = None
    # only the final output (vLLM's RequestOutputKind.FINAL_ONLY): no delta per step, for callers that
    # wait for the end (the offline LLM.generate); the final output carries everything either way
    final_only: bool = False


def sample_requests(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    cache_salt: str | None = None,
    reuse: ReuseOptions | None = None,
    final_only: bool = False,
) -> list[Request]:
    """The `params.n` engine Requests of one prompt, ids `{request_id}-{j}`. Seeded samples get seeds
    seed, seed+1, ... (wrapping inside int64), so sample j equals a single request with seed+j."""
    requests = []
    for j in range(params.n):
        sample = params
        if params.seed is not None and params.n > 1:
            seed = (params.seed + j - INT64_MIN) % 2**64 + INT64_MIN
            sample = dataclasses.replace(params, seed=seed)
        requests.append(
            Request(
                f"{request_id}-{j}",
                list(prompt_token_ids),
                sample,
                cache_salt=cache_salt,
                reuse=reuse,
                final_only=final_only,
            )
        )
    return requests


def warm_request(
    request_id: str, token_ids: Sequence[int], pin: bool = True, cache_salt: str | None = None
) -> Request:
    """Computes and registers the KV of `token_ids` (pinned if `pin`) and generates nothing;
    its final output feeds WarmResult.from_output."""
    return Request(
        request_id,
        list(token_ids),
        SamplingParams(max_tokens=1),
        cache_salt=cache_salt,
        warm_only=True,
        pin=pin,
    )


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(frozen=True)
class WarmResult:
    """What warming a text did (LLM.warm and POST /v1/warm)."""

    num_tokens: int  # tokens of the text
    num_cacheable_tokens: int  # whole chunks (prefix-matchable); the tail is kept for content matches
    num_cached_tokens: int  # of those, already cached before this call
    num_cached_chunks: int
    num_new_chunks: int  # chunks computed and added by this call
    pinned: bool

    @classmethod
    def from_output(cls, num_tokens: int, out: RequestOutput, chunk_size: int, pinned: bool) -> WarmResult:
        num_chunks = num_tokens // chunk_size
        num_cached_chunks = out.num_exact_cached_tokens // chunk_size
        return cls(
            num_tokens,
            num_chunks * chunk_size,
            out.num_exact_cached_tokens,
            num_cached_chunks,
            num_chunks - num_cached_chunks,
            pinned,
        )


@dataclass
class RequestOutput:
    """One request's output: a delta while it runs, one final summary when it ends.

    A delta (finished False) carries only what is new since the previous output: new_token_ids,
    new_text (which starts at character `text_offset` of the whole text), new_logprobs, and the
    prompt's logprobs once; its token_ids, text and logprobs are empty, so an output costs the same
    at the 4,000th token as at the first. The final output (finished True) carries its last delta
    and the whole generation in token_ids, text and logprobs.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # final: every generated token; a delta: empty
    text: str  # final: the whole generated text (stop string removed); a delta: empty
    new_token_ids: list[int]  # tokens added since the previous output
    new_text: str  # text added since the previous output
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache (exact + approximate)
    num_exact_cached_tokens: int = 0  # reused through the exact prefix match
    num_approx_cached_tokens: int = 0  # reused from content matches (moved and not recomputed)
    num_recomputed_tokens: int = 0  # reused tokens recomputed by the repair
    compute_fraction: float | None = None  # repair forwards only: token-layers computed / full prefill's
    reuse_plan: str | None = None  # with content matches: "taken" or "declined: <why>" (cost-aware choice)
    # a taken plan's repair source: "named by the request", "the server's --recompute-strategy X", or
    # "auto: <preset>, verified on <model> (<command>; data <file>)"
    reuse_preset: str | None = None
    audit: str | None = None  # asked for an audit (audit: true): "queued" or "skipped: <why>"
    estimated_saving: float | None = None  # the choice's estimate: 1 - repair time / exact-only time
    logprobs: list[TokenLogprob] | None = None  # final: one per token in token_ids; a delta: None
    # with SamplingParams.prompt_logprobs, once the whole prompt is computed (in one delta and in the
    # final): one per prompt token, None for the first (nothing precedes it); each scored by the
    # logits at the position before it
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    weight_precision: str | None = None  # NestedFP weights: "fp16" or "fp8", what it was computed at
    new_logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per new token
    text_offset: int = 0  # characters of the whole text before new_text

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
