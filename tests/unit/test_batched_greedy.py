"""The step's batched argmax (engine/sampler.py greedy_tokens) gives each plain greedy row the token
its own sample_one gives, ties included; rows with anything that changes the logits are not plain."""

from __future__ import annotations

import torch

from kvserve.engine.sampler import greedy_tokens, plain_greedy, sample_one
from kvserve.request import SamplingParams


def test_batched_argmax_equals_each_rows_own_sample():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1.0  # a tie: the first index wins in both
    logits[4] = 0.0  # all equal
    params = SamplingParams(temperature=0.0)
    rows = [0, 2, 3, 4]
    singles = [sample_one(logits[r], params, [], [], torch.Generator())[0] for r in rows]
    assert greedy_tokens(logits, rows) == singles
    assert singles[1] == 10 and singles[3] == 0
    assert greedy_tokens(logits, []) == []


def test_only_rows_that_take_the_raw_argmax_are_plain():
    assert plain_greedy(SamplingParams(temperature=0.0))
    assert not plain_greedy(SamplingParams(temperature=0.7))
    assert not plain_greedy(SamplingParams(temperature=0.0, logprobs=1))
    assert not plain_greedy(SamplingParams(temperature=0.0, logit_bias={3: 5.0}))
    assert not plain_greedy(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not plain_greedy(SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert not plain_greedy(SamplingParams(temperature=0.0, frequency_penalty=0.5))
