"""Invariant 1: prefix reuse is exact (tokens equal; fp32 reference logits within 1e-4)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.integration.helpers import corpus_token_ids, generate_with_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CHUNK = 32


def _engines(model: str) -> tuple[LLM, LLM]:
    common = dict(
        model=model,
        attention_backend="reference",
        chunk_size=CHUNK,
        block_size=16,
        max_cache_bytes=200_000_000,
    )
    return LLM(enable_prefix_caching=True, **common), LLM(enable_prefix_caching=False, **common)


@pytest.fixture(scope="module", params=["tiny-random-llama", "smollm2-135m"])
def engines(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    return _engines(request.param)


def test_prefix_reuse_is_exact_for_0_1_several_and_all_shared_chunks(engines: tuple[LLM, LLM]):
    cached, cold = engines
    base = corpus_token_ids(cached, 5 * CHUNK + 7, seed=1)  # 5 full chunks + a tail
    cached.generate([base], GREEDY)  # registers 5 chunks
    cases = {
        "0 shared": corpus_token_ids(cached, 3 * CHUNK + 3, seed=2),
        "1 shared": base[:CHUNK] + corpus_token_ids(cached, 2 * CHUNK, seed=3),
        "several": base[: 3 * CHUNK] + corpus_token_ids(cached, 40, seed=4),
        "all chunks, new tail": base[: 5 * CHUNK] + corpus_token_ids(cached, 5, seed=5),
        "identical prompt": list(base),
        "prompt == whole chunks": base[: 4 * CHUNK],  # full hit: the last token is recomputed
        # shares 20 tokens of the cached chunk 3: its first whole block is reused (ChunkStore.match_blocks)
        "mid-chunk": base[: 3 * CHUNK + 20] + corpus_token_ids(cached, 15, seed=6),
    }
    expected_cached = {
        "0 shared": 0,
        "1 shared": CHUNK,
        "several": 3 * CHUNK,
        "all chunks, new tail": 5 * CHUNK,
        "identical prompt": 5 * CHUNK,
        "prompt == whole chunks": 3 * CHUNK + 16,  # and chunk 3's first block: 31 tokens were left
        "mid-chunk": 3 * CHUNK + 16,
    }
    for name, prompt in cases.items():
        (warm,), (warm_logits,) = generate_with_logits(cached, [prompt], GREEDY)
        (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
        assert warm.num_cached_tokens == expected_cached[name], name
        assert ref.num_cached_tokens == 0
        assert warm.token_ids == ref.token_ids, name
        diff = (warm_logits - ref_logits).abs().max().item()
        assert diff <= 1e-4, f"{name}: logits differ by {diff}"


def test_cache_salt_isolates_tenants(engines: tuple[LLM, LLM]):
    cached, _ = engines
    prompt = corpus_token_ids(cached, 3 * CHUNK + 1, seed=11)
    cached.generate([prompt], GREEDY, cache_salt="tenant-a")
    (other,) = cached.generate([prompt], GREEDY, cache_salt="tenant-b")
    (same,) = cached.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 3 * CHUNK
    assert same.token_ids == other.token_ids


def test_a_finished_requests_last_whole_blocks_are_reused_exactly(engines: tuple[LLM, LLM]):
    """The blocks a request computed after its last full chunk stay cached (KVCacheManager.commit_blocks):
    the next question over the same system prompt reuses the system prompt's end to the block, the next
    turn reuses the reply's blocks, and every answer equals the cache-off engine's."""
    cached, cold = engines
    system = corpus_token_ids(cached, 2 * CHUNK + 17, seed=21)  # ends 17 tokens into chunk 2
    first = system + corpus_token_ids(cached, 2, seed=22)
    (done,) = cached.generate([first], GREEDY)  # computes 83 + 11 tokens: chunk 2 never fills
    computed = len(first) + len(done.token_ids) - 1  # the last reply token's KV is never computed
    assert computed < 3 * CHUNK
    cases = {
        # shares chunk 2's first block (16 of its 17 system tokens) with the first request's tail blocks
        "next question": (system + corpus_token_ids(cached, 7, seed=23), 2 * CHUNK + 16),
        # the first prompt, its reply and a new turn: whole blocks up to the last one the first computed
        "next turn": (first + done.token_ids + corpus_token_ids(cached, 5, seed=24), computed // 16 * 16),
    }
    for name, (prompt, num_cached) in cases.items():
        (warm,), (warm_logits,) = generate_with_logits(cached, [prompt], GREEDY)
        (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
        assert warm.num_cached_tokens == num_cached, name
        assert warm.token_ids == ref.token_ids, name
        assert (warm_logits - ref_logits).abs().max().item() <= 1e-4, name


def test_twins_admitted_after_a_prompt_reuse_its_last_whole_blocks(engines: tuple[LLM, LLM]):
    """Prompts sent together over a shared system prompt: the first computes it, the others wait for its
    chunks and, once its prompt is in, reuse its whole blocks past them too (registered at prompt end)."""
    cached, cold = engines
    system = corpus_token_ids(cached, 3 * CHUNK + 18, seed=31)  # chunk 3 has one whole shared block
    prompts = [system + corpus_token_ids(cached, 6, seed=32 + i) for i in range(3)]
    warm, warm_logits = generate_with_logits(cached, prompts, GREEDY)
    ref, ref_logits = generate_with_logits(cold, prompts, GREEDY)
    assert [o.num_cached_tokens for o in warm] == [0, 3 * CHUNK + 16, 3 * CHUNK + 16]
    for w, r, wl, rl in zip(warm, ref, warm_logits, ref_logits, strict=True):
        assert w.token_ids == r.token_ids
        assert (wl - rl).abs().max().item() <= 1e-4
