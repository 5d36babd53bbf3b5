"""Helpers shared by engine-level tests."""

from __future__ import annotations

import random

import torch

from kvserve import LLM, SamplingParams
from kvserve.request import RequestOutput, ReuseOptions

_CORPUS: dict[int, list[int]] = {}


def corpus_token_ids(llm: LLM, n: int, seed: int) -> list[int]:
    """n tokens of real English text (Python's bundled docs) from a seed-chosen offset."""
    from pydoc_data.topics import topics

    key = id(llm.tokenizer.hf.__class__)
    if key not in _CORPUS:
        _CORPUS[key] = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    ids = _CORPUS[key]
    start = random.Random(seed).randrange(len(ids) - n)
    return ids[start : start + n]


def generate_with_logits(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    reuse: ReuseOptions | None = None,
) -> tuple[list[RequestOutput], list[torch.Tensor]]:
    """Generate and return, per output, the stacked raw logits of every sampled step."""
    llm.engine.update.logits_sink = {}
    llm.engine.check_integrity_each_step = True
    try:
        outs = llm.generate(prompts, params, reuse=reuse)
        logits = [torch.stack(llm.engine.update.logits_sink[o.request_id]) for o in outs]
    finally:
        llm.engine.update.logits_sink = None
    return outs, logits
