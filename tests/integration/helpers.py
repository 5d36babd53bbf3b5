"""Helpers shared by engine-level tests."""

from __future__ import annotations

import random

import torch

from kvserve import LLM, SamplingParams
from kvserve.request import RequestOutput


def corpus_token_ids(llm: LLM, n: int, seed: int) -> list[int]:
    """n tokens of real English text (Python's bundled docs), from a seed-chosen topic."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += llm.tokenizer.encode(topics[keys[rng.randrange(len(keys))]])
    return ids[:n]


def generate_with_logits(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> tuple[list[RequestOutput], list[torch.Tensor]]:
    """Generate and return, per output, the stacked raw logits of every sampled step."""
    llm.engine.logits_sink = {}
    llm.engine.check_integrity_each_step = True
    try:
        outs = llm.generate(prompts, params)
        logits = [torch.stack(llm.engine.logits_sink[o.request_id]) for o in outs]
    finally:
        llm.engine.logits_sink = None
    return outs, logits
