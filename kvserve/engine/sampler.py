"""Per-request sampling: logits processors, greedy or seeded sampling, logprobs, one row at a time.

Each request samples with its own torch.Generator, so the same seed gives the same tokens whatever
else is in the batch. The step samples its whole batch with engine/batch_sampler.py, which gives
every row what `sample_one` gives it (bitwise); `sample_one` is its reference and the step's
fallback when the batched call raises.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from kvserve.request import SamplingParams, TokenLogprob


def apply_penalties(
    logits: torch.Tensor,  # [vocab] float32, modified in place
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> None:
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        counts = Counter(output_token_ids)
        ids = torch.tensor(list(counts.keys()), dtype=torch.long)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
        logits[ids] -= params.frequency_penalty * freq + params.presence_penalty


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p -> probabilities [vocab]. The max is subtracted before
    dividing by the temperature, so no positive temperature overflows to inf."""
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def plain_greedy(params: SamplingParams) -> bool:
    """Its token is the argmax of the raw logits: greedy, and nothing changes the logits or asks for
    logprobs (a grammar mask is the caller's to rule out)."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
    )


def sample_one(
    logits: torch.Tensor,  # [vocab] float32 raw model logits
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,  # [vocab] bool: a structured output's grammar mask
) -> tuple[int, TokenLogprob | None]:
    """The next token and, if asked, its logprob. `allowed` (a grammar's mask) removes every other
    token before sampling; logprobs stay the model's raw ones (before penalties and the mask)."""
    raw = logits.float()
    x = raw.clone()
    apply_penalties(x, params, prompt_token_ids, output_token_ids)
    if allowed is not None:
        x.masked_fill_(~allowed, float("-inf"))
    if params.greedy:
        token_id = int(torch.argmax(x))
    else:
        probs = filter_logits(x, params)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    logprob = None
    if params.logprobs is not None:
        logprobs = torch.log_softmax(raw, dim=-1)
        top = torch.topk(logprobs, params.logprobs) if params.logprobs > 0 else None
        alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        logprob = TokenLogprob(token_id, float(logprobs[token_id]), alternatives)
    return token_id, logprob
