"""Sequence: what one Request is and where it stands (its tokens, progress, status, sampling). Batch
tensors are derived from it once per step (ModelRunner).

The rest of a request's state lives with its owner, keyed by request id: its blocks and the chunks
it uses or computes with the KVCacheManager (kvcache/manager.py), its output text, logprobs and what
was streamed with the OutputProcessor (engine/output.py), its content pieces with the ContentMatcher,
a content-reuse repair in progress with Repairs (reuse/repair.py),
the precisions its steps ran at with the PrecisionPolicy, a pinning warm's booking with WarmPins,
a tier load it waits for with EngineTiers, an audit's trace with the Auditor.

  SeqCache     what names its KV in the cache: the root and chunk prefix hashes
  ReuseReport  what the cache saved it (a value, replaced as admission and repair fix it)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.request import FinishReason, Request, TokenLogprob

if TYPE_CHECKING:
    from kvserve.structured import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqCache:
    root_hash: bytes  # namespace + cache_salt
    prefix_hashes: list[bytes] = field(default_factory=list)  # of the full chunks of token_ids


@dataclass(frozen=True)
class ReuseReport:
    """What the cache saved a request: set at its first admission (exact prefix), its content-reuse
    decision, and its repair's end; a re-admission after preemption keeps it. Replaced, never changed."""

    num_exact_cached_tokens: int = 0
    num_approx_cached_tokens: int = 0  # moved from content matches and not recomputed
    num_recomputed_tokens: int = 0  # moved, then recomputed by the repair
    compute_fraction: float | None = None  # repair: token-layers computed / a full prefill's
    plan: str | None = None  # the content-reuse decision (ContentMatcher.choose): "taken" or "declined"
    plan_reason: str | None = None
    preset: str | None = None  # a taken plan's repair source (ReusePlan.preset)
    estimated_saving: float | None = None  # 1 - estimated repair time / exact-only prefill time
    strategy: str | None = None  # the repair strategy of the served prompt (set when its repair ends)
    hit_keys: tuple[bytes, ...] = ()  # content keys it reused (the audit guard's)


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator
    cache: SeqCache
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose KV is in the pool: [0, num_computed_tokens)
    # with SamplingParams.prompt_logprobs: prompt tokens 1, 2, ... scored so far (token j by the logits
    # at position j - 1), so the logits of positions [0, len) are no longer needed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    report: ReuseReport | None = None  # None until its first admission
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # structured output: where its generated tokens are in the grammar; it advances only when a token
    # is sampled, so preemption (which recomputes KV, never resamples) leaves it as it is
    grammar: GrammarMatcher | None = None
    # NestedFP weights: the precision it was admitted at ("fp16" or "fp8"; its root hash names it, so it
    # reuses and caches only KV of that precision); None with dense weights
    precision: str | None = None
    # asked for an audit (audit: true): what became of it, "queued" or "skipped: <why>" (the Auditor's)
    audit: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: it costs the output's length (num_output_tokens does not)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def generates(self) -> bool:
        """False for requests that only compute their prompt: warms and max_tokens=0 (prompt logprobs,
        echo). Their last prompt row is never sampled."""
        return not self.request.warm_only and self.request.sampling_params.max_tokens > 0

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs are requested and not all computed: logits of prompt positions from
        len(out.prompt_logprobs) on are still needed, so the prefix cache may give it only KV before
        that (Admissions.max_match_chunks)."""
        k = self.request.sampling_params.prompt_logprobs
        return k is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
