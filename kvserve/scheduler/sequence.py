"""Sequence: the engine's mutable state of one Request, split by the resource each part describes.
The request owns its state; batch tensors are derived from it once per step (ModelRunner).

  SeqKV      its hold on the KV pool: blocks and how many tokens' KV they hold (scheduler)
  SeqCache   its relation to the chunk store: hashes, chunks it uses, chunks it will register (scheduler)
  SeqReuse   what the cache saved it, and its content pieces for approximate reuse (scheduler, content)
  SeqOutput  the text it produced and what was streamed (engine.output.OutputProcessor)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.request import FinishReason, Request, TokenLogprob
from kvserve.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kvserve.scheduler.repair import Repair
    from kvserve.structured import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqKV:
    block_ids: list[int] = field(default_factory=list)  # owned, one pool ref each, in position order
    num_computed_tokens: int = 0  # tokens whose KV is in the pool: [0, num_computed_tokens)


@dataclass
class SeqCache:
    root_hash: bytes  # namespace + cache_salt
    prefix_hashes: list[bytes] = field(default_factory=list)  # of the full chunks of token_ids
    used_chunks: list[bytes] = field(default_factory=list)  # cached chunks this sequence is a user of
    num_chunks_in_store: int = 0  # leading chunks cached and held (matched, registered or adopted)
    in_flight: list[bytes] = field(default_factory=list)  # prompt chunks it computes and will register
    register_limit: int | None = None  # chunks from this index on hold approximate KV: never registered
    tier_checked: bool = False  # its chunks were looked up in the KV tiers below the pool
    tier_job: object | None = None  # a load from the disk / Redis tier it waits for (tiers/manager.py)


@dataclass
class SeqReuse:
    source_id: int = 0  # unique per sequence: identifies runs of pieces from one prompt
    pieces: list[tuple[int, int]] = field(default_factory=list)  # prompt pieces for content matching
    num_pieces_registered: int = 0
    admitted_once: bool = False
    # what the cache saved, fixed at the first admission (re-admission after preemption keeps them)
    num_exact_cached_tokens: int = 0
    num_approx_cached_tokens: int = 0  # moved from content matches and not recomputed
    num_recomputed_tokens: int = 0  # moved, then recomputed by the repair
    compute_fraction: float | None = None  # repair: token-layers computed / a full prefill's
    # the content-reuse plan decision at the first admission that found matches (ContentMatcher.choose)
    plan: str | None = None  # "taken" or "declined"
    plan_reason: str | None = None
    estimated_saving: float | None = None  # 1 - estimated repair time / exact-only prefill time
    repair: Repair | None = None  # the repair in progress (while admitted)
    strategy: str | None = None  # the repair strategy of the served prompt (set when its repair ends)
    hit_keys: list[bytes] = field(default_factory=list)  # content keys it reused (the audit guard's)


@dataclass
class SeqOutput:
    detokenizer: IncrementalDetokenizer | None  # None for warm requests (they generate nothing)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: prompt tokens 1, 2, ... scored so far (token j by the logits
    # at position j - 1), so the logits of positions [0, len) are no longer needed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    prompt_logprobs_emitted: bool = False  # a delta carried them (they go out once, and in the final)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator
    cache: SeqCache
    out: SeqOutput
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    kv: SeqKV = field(default_factory=SeqKV)
    reuse: SeqReuse = field(default_factory=SeqReuse)
    status: SeqStatus = SeqStatus.WAITING
    pin_owner: bytes | None = None  # a pinning warm: the owner its pins are counted under
    num_reserved_pin_blocks: int = 0  # a pinning warm's booking in the store's pin budget
    # structured output: where its generated tokens are in the grammar; it advances only when a token
    # is sampled, so preemption (which recomputes KV, never resamples) leaves it as it is
    grammar: GrammarMatcher | None = None
    # NestedFP weights: the precision it was admitted at ("fp16" or "fp8"; its root hash names it, so it
    # reuses and caches only KV of that precision); None with dense weights
    precision: str | None = None
    step_precision: str | None = None  # what its rows compute at in the current step (engine/precision.py)
    precisions_used: set[str] = field(default_factory=set)  # every step precision it ran at

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
        return k is not None and len(self.out.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
