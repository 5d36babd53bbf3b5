"""Invariant 2: batching is invisible; chunked prefill and preemption do not change outputs."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.integration.helpers import corpus_token_ids, generate_with_logits

PARAMS = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=2, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.2, min_p=0.05, seed=4, ignore_eos=True),
    SamplingParams(
        max_tokens=11, temperature=0, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True
    ),
    SamplingParams(max_tokens=5, temperature=0.9, seed=5, logprobs=3, ignore_eos=True),
]


@pytest.fixture(
    scope="module",
    params=[("tiny-random-llama", "auto"), ("smollm2-135m", "auto"), ("tiny-random-llama", "hf")],
    ids=["tiny-random-llama", "smollm2-135m", "tiny-random-llama-hf-forward"],
)
def llm(request: pytest.FixtureRequest) -> LLM:
    model, forward = request.param
    return LLM(
        model=model,
        model_forward=forward,
        attention_backend="reference",
        chunk_size=32,
        max_cache_bytes=200_000_000,
        enable_prefix_caching=False,
    )


def test_eight_requests_together_equal_each_alone(llm: LLM):
    prompts = [corpus_token_ids(llm, n, seed=i) for i, n in enumerate([5, 40, 77, 13, 120, 64, 3, 90])]
    together, together_logits = generate_with_logits(llm, prompts, PARAMS)
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
        (alone,), (alone_logits,) = generate_with_logits(llm, [prompt], params)
        assert together[i].token_ids == alone.token_ids, f"request {i}"
        diff = (together_logits[i] - alone_logits).abs().max().item()
        assert diff <= 1e-4, f"request {i}: logits differ by {diff}"


def test_chunked_prefill_and_tiny_step_budget_give_the_same_tokens():
    big = LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=50_000_000)
    small = LLM(
        model="tiny-random-llama", chunk_size=32, max_cache_bytes=50_000_000, max_num_batched_tokens=16
    )
    prompts = [corpus_token_ids(big, n, seed=20 + n) for n in (150, 33, 70)]
    a = big.generate(prompts, PARAMS[:3])
    small.engine.check_integrity_each_step = True
    b = small.generate(prompts, PARAMS[:3])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_preemption_under_memory_pressure_keeps_outputs_and_balance():
    roomy = LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=50_000_000)
    # 1 KiB per token: 24 blocks of 16 tokens = 384 tokens of KV for 6 requests of ~100 tokens each
    tight = LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=24 * 16 * 1024)
    prompts = [corpus_token_ids(roomy, 60 + 7 * i, seed=40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = roomy.generate(prompts, params)
    tight.engine.check_integrity_each_step = True
    got = tight.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert tight.stats().num_preemptions > 0
