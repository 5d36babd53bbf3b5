"""Sequence: the engine's mutable state of one Request. The request owns its state; batch tensors
are derived from it once per step (ModelRunner.prepare_inputs)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvserve.request import FinishReason, Request, TokenLogprob
from kvserve.tokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer | None
    root_hash: bytes
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose KV is in the pool: [0, num_computed_tokens)
    block_ids: list[int] = field(default_factory=list)  # owned, one pool ref each, in position order
    prefix_hashes: list[bytes] = field(default_factory=list)  # of the full chunks of token_ids
    used_chunks: list[bytes] = field(default_factory=list)  # cached chunks this sequence is a user of
    num_chunks_in_store: int = 0  # leading chunks known to be cached (matched or registered)
    num_cached_tokens: int = 0  # prompt tokens reused from the cache (first admission)
    in_flight: list[bytes] = field(default_factory=list)  # prompt chunks this sequence will compute
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    text: str = ""
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    admitted_once: bool = False
    # content reuse
    source_id: int = 0  # unique per sequence: identifies runs of pieces from one prompt
    segments: list[tuple[int, int]] = field(default_factory=list)  # prompt pieces for content matching
    num_segments_registered: int = 0
    register_limit: int | None = None  # chunks from this index on hold approximate KV: never registered
    num_approx_cached_tokens: int = 0
    num_recomputed_tokens: int = 0
    compute_fraction: float | None = None

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
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
