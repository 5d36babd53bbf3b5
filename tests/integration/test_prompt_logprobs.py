"""Prompt logprobs (SamplingParams.prompt_logprobs) against a plain Hugging Face forward in fp32:
each prompt token j >= 1 scored by the logits at j - 1, equal to HF's within 1e-4 whether the prompt
was cached or not and however the prompt was cut into prefill slices; max_tokens=0 (prompt only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.models.loader import resolve_model_path
from kvserve.request import FinishReason, RequestOutput, TokenLogprob
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
PIECE = 48  # max_num_batched_tokens of the engine that cuts prompts into pieces
TOL = 1e-4


def make(model: str, max_num_batched_tokens: int, max_cache_bytes: int = 100_000_000) -> LLM:
    return LLM(
        model=model,
        chunk_size=CHUNK,
        block_size=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_cache_bytes=max_cache_bytes,
    )


@pytest.fixture(scope="module")
def pieces() -> LLM:
    return make("tiny-random-llama", PIECE)


@pytest.fixture(scope="module")
def hf_tiny() -> torch.nn.Module:
    return _hf("tiny-random-llama")


def _hf(model: str) -> torch.nn.Module:
    path = resolve_model_path(model)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab] float32: row j - 1 is the distribution that scores token j."""
    logits = hf(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_equal_to_hf(out: RequestOutput, ref: torch.Tensor, k: int) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(out.prompt_token_ids)
    assert entries[0] is None  # the first token has no context
    scored: list[TokenLogprob] = [e for e in entries[1:] if e is not None]
    assert len(scored) == len(entries) - 1
    assert [e.token_id for e in scored] == out.prompt_token_ids[1:]
    targets = torch.tensor(out.prompt_token_ids[1:])
    want = ref.gather(1, targets[:, None])[:, 0]
    got = torch.tensor([e.logprob for e in scored])
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    top_values = torch.tensor([[lp for _, lp in e.top] for e in scored]).reshape(len(scored), k)
    assert torch.allclose(top_values, ref.topk(k, dim=-1).values, atol=TOL, rtol=0)
    for e, row in zip(scored, ref, strict=True):  # the top ids score what HF gives them, best first
        ids = torch.tensor([t for t, _ in e.top], dtype=torch.long)
        assert torch.allclose(row[ids], torch.tensor([lp for _, lp in e.top]), atol=TOL, rtol=0)
        assert all(a >= b for (_, a), (_, b) in zip(e.top, e.top[1:]))


def test_equal_to_hf_cold_warm_and_cut_into_pieces(pieces: LLM, hf_tiny: torch.nn.Module) -> None:
    prompt = corpus_token_ids(pieces, 5 * CHUNK + 9, seed=11)
    ref = hf_logprobs(hf_tiny, prompt)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    steps = pieces.engine.num_steps
    (cold,) = pieces.generate([prompt], params)
    assert pieces.engine.num_steps - steps >= len(prompt) // PIECE  # cut into several pieces
    assert_equal_to_hf(cold, ref, 3)
    # it registered the chunks it computed: a plain request of the prompt reuses them
    (plain,) = pieces.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert plain.num_cached_tokens == 5 * CHUNK
    # warm: cached positions have no logits, so the request computes its whole prompt again
    (warm,) = pieces.generate([prompt], params)
    assert warm.num_cached_tokens == 0
    assert_equal_to_hf(warm, ref, 3)
    assert [e and (e.token_id, e.logprob, e.top) for e in warm.prompt_logprobs or []] == [
        e and (e.token_id, e.logprob, e.top) for e in cold.prompt_logprobs or []
    ]


def test_one_piece_equals_several_pieces(pieces: LLM, hf_tiny: torch.nn.Module) -> None:
    whole = make("tiny-random-llama", 4096)
    prompt = corpus_token_ids(whole, 4 * CHUNK + 5, seed=12)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    (a,), (b,) = whole.generate([prompt], params), pieces.generate([prompt], params)
    ref = hf_logprobs(hf_tiny, prompt)
    assert_equal_to_hf(a, ref, 2)
    assert_equal_to_hf(b, ref, 2)


def test_prompt_only_requests_generate_nothing(pieces: LLM) -> None:
    prompts = [corpus_token_ids(pieces, n, seed=20 + n) for n in (1, 7, 100)]
    params = [
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        SamplingParams(max_tokens=0),  # echo without logprobs: the prompt alone
        SamplingParams(max_tokens=0, prompt_logprobs=1),
    ]
    beside = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)  # runs in the same steps
    outs = pieces.generate([*prompts, prompts[2]], [*params, beside])
    for out, prompt in zip(outs[:3], prompts, strict=True):
        assert out.finish_reason == FinishReason.LENGTH and out.error is None
        assert out.token_ids == [] and out.text == "" and out.prompt_token_ids == prompt
    one, plain, long = outs[:3]
    assert one.prompt_logprobs == [None]  # a single token has nothing to score
    assert plain.prompt_logprobs is None
    assert long.prompt_logprobs is not None and len(long.prompt_logprobs) == 100
    assert all(len(e.top) == 1 for e in long.prompt_logprobs[1:] if e is not None)
    assert len(outs[3].token_ids) == 5
    pieces.engine.check_integrity()


def test_logprobs_of_k_zero_and_sampled_tokens_unchanged(pieces: LLM) -> None:
    prompt = corpus_token_ids(pieces, 70, seed=30)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (with_prompt,) = pieces.generate([prompt], dataclasses.replace(greedy, prompt_logprobs=0))
    (without,) = pieces.generate([prompt], greedy)
    assert with_prompt.token_ids == without.token_ids
    assert [(e.token_id, e.logprob) for e in with_prompt.logprobs or []] == [
        (e.token_id, e.logprob) for e in without.logprobs or []
    ]
    assert without.prompt_logprobs is None
    entries = with_prompt.prompt_logprobs
    assert entries is not None and all(e.top == [] for e in entries[1:] if e is not None)


def test_smollm2_equal_to_hf_cold_and_warm() -> None:
    llm = make("smollm2-135m", 64)
    prompt = corpus_token_ids(llm, 3 * CHUNK + 4, seed=40)
    ref = hf_logprobs(_hf("smollm2-135m"), prompt)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    (cold,) = llm.generate([prompt], params)
    assert_equal_to_hf(cold, ref, 2)
    llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's chunks are cached now
    (warm,) = llm.generate([prompt], params)
    assert_equal_to_hf(warm, ref, 2)


def test_preempted_requests_keep_their_prompt_logprobs(pieces: LLM) -> None:
    """A pool too small for three long requests: they are preempted (in prefill and in decode) and
    recomputed; the prompt logprobs and tokens equal those of a pool that fits them all."""
    small = make("tiny-random-llama", PIECE, max_cache_bytes=400_000)  # 24 blocks of 16 tokens
    prompts = [corpus_token_ids(pieces, n, seed=50 + n) for n in (150, 170, 190)]
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, prompt_logprobs=2)
    small.engine.check_integrity_each_step = True
    outs, refs = small.generate(prompts, params), pieces.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, refs, strict=True):
        assert out.error is None and out.token_ids == ref.token_ids
        assert [e and (e.token_id, e.logprob, e.top) for e in out.prompt_logprobs or []] == [
            e and (e.token_id, e.logprob, e.top) for e in ref.prompt_logprobs or []
        ]
