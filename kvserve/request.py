"""The plain values that cross layer boundaries: SamplingParams, Request (API -> engine) and
RequestOutput (engine -> API)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client gone, timeout or engine shutdown
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. `validate()` raises InvalidRequestError naming the field."""

    max_tokens: int = 16
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
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1 (got {self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100] (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or positive (got {self.top_k})")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be positive (got {self.repetition_penalty})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2] (got {getattr(self, name)})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20] (got {self.logprobs})")
        if not 1 <= self.n <= 16:
            raise bad("n", f"must be in [1, 16] (got {self.n})")
        if any(not s for s in self.stop):
            raise bad("stop", "strings must be non-empty")
        if len(self.stop) > 8:
            raise bad("stop", f"accepts at most 8 strings (got {len(self.stop)})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ReuseOptions:
    """Per-request opt-in to approximate (content) reuse and its repair; None = the server's setting."""

    reuse: str | None = None  # "prefix" (exact only) or "any"
    recompute_strategy: str | None = None  # none, selective, cacheblend
    recompute_tokens: int | None = None
    recompute_ratio: float | None = None
    blend_check_layer: int | None = None

    def __post_init__(self) -> None:
        if self.reuse not in (None, "prefix", "any"):
            raise InvalidRequestError(f"reuse must be 'prefix' or 'any' (got {self.reuse!r})", param="reuse")
        if self.recompute_strategy not in (None, "none", "selective", "cacheblend"):
            raise InvalidRequestError(
                f"recompute_strategy must be none, selective or cacheblend (got {self.recompute_strategy!r})",
                param="recompute_strategy",
            )
        if self.recompute_tokens is not None and self.recompute_tokens < 0:
            raise InvalidRequestError("recompute_tokens must be >= 0", param="recompute_tokens")
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise InvalidRequestError("recompute_ratio must be in [0, 1]", param="recompute_ratio")
        if self.blend_check_layer is not None and self.blend_check_layer < 0:
            raise InvalidRequestError("blend_check_layer must be >= 0", param="blend_check_layer")


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
    """A delta (streaming) or cumulative (finished) view of one request's generation."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    text: str  # all generated text so far (stop string removed)
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text added by this step
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache (exact + approximate)
    num_exact_cached_tokens: int = 0  # reused through the exact prefix match
    num_approx_cached_tokens: int = 0  # reused from content matches (moved and not recomputed)
    num_recomputed_tokens: int = 0  # reused tokens recomputed by the repair
    compute_fraction: float | None = None  # repair forwards only: token-layers computed / full prefill's
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids (cumulative)
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
