"""Prompt logprobs (SamplingParams.prompt_logprobs = k): each prompt token j >= 1 scored by the logits
at position j - 1, its log probability plus the k most likely tokens there. Token 0 has no score.

Which rows: a prefill slice computing positions [start, end) scores the tokens after those of its
positions that still need it (`rows_to_score`); the model runner turns those hidden rows into
logits a block of ROWS_PER_BLOCK rows at a time and keeps only the numbers (`score`), so a long
prompt never holds [prompt_len, vocab] float32 logits.

Cached positions have no logits, so such a request takes from the prefix cache only the KV of
positions it has already scored (Admissions.max_match_chunks): at its first admission none, so it
computes its whole prompt ("skip reuse"; the cached KV is what the recompute gives, bit for bit on
CPU, so the cost is time only). It still registers the chunks it computes, for later requests; a
re-admission after preemption reuses them up to what it scored. Content (approximate) reuse is never
used for it (ContentMatcher.wants).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.request import TokenLogprob
from kvserve.scheduler.sequence import Sequence

# logits rows made at once: [256, vocab] float32 is 50 MB for SmolLM2's 49,152 tokens
ROWS_PER_BLOCK = 256


@dataclass(frozen=True)
class PromptRows:
    """Rows [first_row, first_row + num_rows) of a packed step are prompt positions
    [first_position, first_position + num_rows) of `seq`; each scores the prompt token after it."""

    seq: Sequence
    first_row: int
    first_position: int
    num_rows: int

    @property
    def target_ids(self) -> list[int]:
        """The prompt tokens these rows score."""
        start = self.first_position + 1
        return self.seq.token_ids[start : start + self.num_rows]


def rows_to_score(seq: Sequence, start: int, end: int) -> tuple[int, int] | None:
    """Positions [lo, hi) of a slice computing [start, end) whose logits give prompt logprobs not yet
    recorded (the last prompt position scores no prompt token); None when there are none."""
    if not seq.wants_prompt_logits:
        return None
    lo = max(start, len(seq.prompt_logprobs))
    hi = min(end, seq.num_prompt_tokens - 1)
    return (lo, hi) if lo < hi else None


def record(scored: list[tuple[PromptRows, list[TokenLogprob]]]) -> None:
    """A step's prompt logprobs (ModelRunner StepOutput.prompt_logprobs) onto their sequences."""
    for rows, entries in scored:
        recorded = rows.seq.prompt_logprobs
        assert len(recorded) == rows.first_position, "prompt positions are scored in order, once"
        recorded += entries


def score(logits: torch.Tensor, target_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [rows, vocab] float32 -> per row the target token's logprob and the top-k (token,
    logprob) pairs, best first (raw model logprobs, like the sampled tokens' own)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp, []) for t, lp in zip(target_ids, chosen, strict=True)]
    top = torch.topk(logprobs, k, dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(t, lp, list(zip(i, v, strict=True)))
        for t, lp, i, v in zip(target_ids, chosen, ids, values, strict=True)
    ]
