"""Pool balance, aborts, eviction under a budget, warm/pin, prefix-grouped admission, bad input."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError, ModelNotFoundError
from kvserve.request import FinishReason, Request
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture()
def llm() -> LLM:
    llm = LLM(model="tiny-random-llama", chunk_size=CHUNK, max_cache_bytes=20_000_000)
    llm.engine.check_integrity_each_step = True
    return llm


def _all_used_blocks_are_cached(llm: LLM) -> None:
    pool, store = llm.engine.pool, llm.engine.store
    assert pool.num_free_blocks + store.num_cached_blocks == pool.num_blocks
    llm.engine.check_integrity()


def test_after_requests_finish_every_used_block_belongs_to_a_cached_chunk(llm: LLM):
    prompts = [corpus_token_ids(llm, n, seed=n) for n in (10, 70, 130, 200)]
    llm.generate(prompts, GREEDY)
    _all_used_blocks_are_cached(llm)
    chunks = llm.engine.store.chunks()
    assert sum(c.num_tokens == CHUNK for c in chunks) == sum((n + 8 - 1) // CHUNK for n in (10, 70, 130, 200))
    # block tails (KVCacheManager.commit_blocks): whole blocks past a request's last full chunk; of the
    # 17, 77, 137 and 207 tokens computed only the first request's leave one (16 tokens)
    assert sorted(c.num_tokens for c in chunks if c.num_tokens < CHUNK) == [16]


def test_aborts_leave_no_leaks(llm: LLM):
    engine = llm.engine
    prompts = [corpus_token_ids(llm, 100 + i, seed=i) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    engine.step()
    engine.step()
    assert engine.abort_request("r0") and engine.abort_request("r3")
    assert not engine.abort_request("r0")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert (
        finished["r0"].finish_reason == FinishReason.ABORT
        and finished["r3"].finish_reason == FinishReason.ABORT
    )
    assert finished["r1"].finish_reason == FinishReason.LENGTH
    _all_used_blocks_are_cached(llm)


def test_eviction_keeps_budget_and_spares_pinned_chunks():
    llm = LLM(model="tiny-random-llama", chunk_size=CHUNK, max_cache_bytes=40 * 16 * 1024)  # 40 blocks
    llm.engine.check_integrity_each_step = True
    pinned_text = corpus_token_ids(llm, 2 * CHUNK, seed=99)
    result = llm.warm(pinned_text, pin=True)
    assert (result.num_new_chunks, result.num_cached_chunks, result.pinned) == (2, 0, True)
    budget = llm.engine.config.max_cache_bytes
    for i in range(12):
        llm.generate([corpus_token_ids(llm, 3 * CHUNK + 5, seed=i)], GREEDY)
        stats = llm.stats()
        assert stats.store.cached_bytes <= budget
    assert llm.stats().num_evictions > 0
    again = llm.warm(pinned_text)
    assert (again.num_new_chunks, again.num_cached_chunks) == (0, 2)
    (out,) = llm.generate([pinned_text + [42, 43]], GREEDY)
    assert out.num_cached_tokens == 2 * CHUNK
    assert llm.unpin(pinned_text) == 2


def test_prefix_grouped_admission_computes_a_shared_prefix_once(llm: LLM):
    shared = corpus_token_ids(llm, 4 * CHUNK, seed=5)
    prompts = [shared + corpus_token_ids(llm, 10, seed=50 + i) for i in range(4)]
    outs = llm.generate(prompts, GREEDY)
    computed = llm.stats().num_prompt_tokens_computed
    assert computed == 4 * CHUNK + 4 * 10, computed  # the shared 4 chunks once, each suffix once
    assert [o.num_cached_tokens for o in outs].count(4 * CHUNK) == 3
    cold = LLM(model="tiny-random-llama", chunk_size=CHUNK, enable_prefix_caching=False)
    assert [o.token_ids for o in cold.generate(prompts, GREEDY)] == [o.token_ids for o in outs]


def test_n_samples_share_the_prompt(llm: LLM):
    prompt = corpus_token_ids(llm, 3 * CHUNK + 4, seed=6)
    outs = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True))
    assert len(outs) == 3
    assert sorted(o.num_cached_tokens for o in outs) == [0, 3 * CHUNK, 3 * CHUNK]
    assert llm.stats().num_prompt_tokens_computed == len(prompt) + 2 * 4


def test_bad_input_is_rejected_and_the_engine_keeps_running(llm: LLM):
    engine = llm.engine
    limit = engine.info.max_model_len
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(Request("long", [5] * limit, GREEDY))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(Request("empty", [], GREEDY))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(Request("oov", [10**7], GREEDY))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)  # 0 is a prompt-only request (test_prompt_logprobs.py)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    # max_tokens past the context is clipped: finish reason `length` at the context limit
    (out,) = llm.generate([[7] * (limit - 3)], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3
    (ok,) = llm.generate([[1, 2, 3]], GREEDY)
    assert len(ok.token_ids) == 8


def test_unknown_model_lists_builtins():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        LLM(model="no-such-model")


def test_warm_counts_whole_chunks_when_the_text_has_a_tail(llm: LLM):
    """Regression: the tail kept for content matches once made num_cached_chunks negative."""
    text = corpus_token_ids(llm, 2 * CHUNK + 16, seed=8)
    first = llm.warm(text)
    assert (first.num_cacheable_tokens, first.num_new_chunks, first.num_cached_chunks) == (2 * CHUNK, 2, 0)
    again = llm.warm(text)
    assert (again.num_new_chunks, again.num_cached_chunks, again.num_cached_tokens) == (0, 2, 2 * CHUNK)
