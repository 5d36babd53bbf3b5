"""The paths off the exact-prefix road: content reuse under preemption and next to exact twins,
counted pins and their cap, admission that never waits for blocks that cannot be freed, eviction that
never orphans a chunk, and a content index bounded by the store."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import chunk_prefix_hashes, root_hash
from kvserve.request import FinishReason, Request, RequestOutput, ReuseOptions
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EXACT_REPAIR = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
BYTES_PER_BLOCK = 16 * 1024  # tiny-random-llama: 1 KiB of KV per token, 16 tokens per block


def make(**kw) -> LLM:
    kw.setdefault("max_cache_bytes", 50_000_000)
    kw.setdefault("reuse_min_saving", -10.0)  # take every content match (the full repairs too)
    llm = LLM(model="tiny-random-llama", chunk_size=CHUNK, pieces="fixed", **kw)
    llm.engine.check_integrity_each_step = True
    return llm


def run(llm: LLM, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not llm.engine.has_unfinished_requests():
            break
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def chain(llm: LLM, tokens: list[int], salt: str | None = None) -> list[bytes]:
    return chunk_prefix_hashes(tokens, CHUNK, root_hash(llm.engine.info.namespace, salt))


def assert_reachable(llm: LLM, prompts: list[list[int]]) -> None:
    """Every cached chunk of these prompts has its parent cached too."""
    store = llm.engine.store
    for p in prompts:
        hashes = chain(llm, p)
        for i in range(1, len(hashes)):
            if hashes[i] in store:
                assert hashes[i - 1] in store, f"chunk {i} is cached but its parent is not"


# --- content reuse --------------------------------------------------------------------------------
def _rag(llm: LLM, seed: int) -> list[int]:
    doc = corpus_token_ids(llm, 3 * CHUNK, seed=seed)
    llm.warm(doc)
    return corpus_token_ids(llm, 2 * CHUNK, seed=seed + 1) + doc + corpus_token_ids(llm, 7, seed=seed + 2)


def test_content_reuse_preempted_after_n_tokens_continues_where_it_stopped():
    llm, cold = make(), make(enable_prefix_caching=False)
    prompt = _rag(llm, seed=400)
    (ref,) = cold.generate([prompt], GREEDY)
    engine = llm.engine
    engine.add_request(Request("r", prompt, GREEDY, reuse=EXACT_REPAIR))
    seq = engine.scheduler.find("r")
    assert seq is not None
    while len(seq.output_token_ids) < 5:
        engine.step()
    engine.scheduler.preempt(seq)
    (out,) = run(llm).values()
    assert out.num_approx_cached_tokens + out.num_recomputed_tokens == 3 * CHUNK
    assert out.token_ids == ref.token_ids


def test_a_content_reuse_request_does_not_stall_its_exact_twin():
    llm, cold = make(), make(enable_prefix_caching=False)
    prompt = _rag(llm, seed=410)
    (ref,) = cold.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine = llm.engine
    engine.add_request(
        Request(
            "any", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), reuse=EXACT_REPAIR
        )
    )
    engine.add_request(Request("exact", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    order = []
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                order.append(out)
        if len(order) == 2:
            break
    assert [o.request_id for o in order] == ["exact", "any"], "the exact twin waited for the whole generation"
    assert order[0].token_ids == ref.token_ids


# --- pins -----------------------------------------------------------------------------------------
def test_pins_are_counted_per_owner():
    llm = make(max_cache_bytes=64 * BYTES_PER_BLOCK)
    system = corpus_token_ids(llm, 2 * CHUNK, seed=420)
    doc_a = system + corpus_token_ids(llm, 2 * CHUNK, seed=421)
    doc_b = system + corpus_token_ids(llm, 2 * CHUNK, seed=422)
    llm.warm(doc_a, pin=True)
    llm.warm(doc_b, pin=True)
    assert llm.unpin(doc_a) == 4  # doc A's pins on its 4 chunks are released...
    assert llm.unpin(doc_a) == 0  # ...once
    llm.engine.store.evict(10**6)
    store, a, b = llm.engine.store, chain(llm, doc_a), chain(llm, doc_b)
    assert all(h in store for h in b), "doc B (and the system chunks it shares with A) stay pinned"
    assert not any(h in store for h in a[2:]), "doc A's own chunks are no longer pinned"
    assert llm.unpin(doc_b) == 4 and llm.unpin(corpus_token_ids(llm, CHUNK, seed=423)) == 0


def test_pinned_memory_is_capped():
    llm = make(max_cache_bytes=40 * BYTES_PER_BLOCK, max_pinned_fraction=0.25)  # 10 of 40 blocks
    first = corpus_token_ids(llm, 4 * CHUNK, seed=430)  # 8 blocks
    assert llm.warm(first, pin=True).pinned
    with pytest.raises(InvalidRequestError, match="max_pinned_fraction"):
        llm.warm(corpus_token_ids(llm, 2 * CHUNK, seed=431), pin=True)  # 8 + 4 > 10
    assert llm.warm(corpus_token_ids(llm, 2 * CHUNK, seed=432), pin=False).num_new_chunks == 2
    llm.unpin(first)
    assert llm.warm(corpus_token_ids(llm, 2 * CHUNK, seed=431), pin=True).pinned


def test_admission_never_waits_for_blocks_that_cannot_be_freed():
    llm = make(max_cache_bytes=40 * BYTES_PER_BLOCK, max_pinned_fraction=0.9)
    llm.warm(corpus_token_ids(llm, 16 * CHUNK, seed=440), pin=True)  # 32 of 40 blocks pinned
    engine = llm.engine
    big = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)  # 100 + 100 tokens: 13 blocks
    try:
        engine.add_request(Request("big", corpus_token_ids(llm, 100, seed=441), big))
    except InvalidRequestError as e:
        assert "pinned" in e.message
    engine.add_request(Request("small", corpus_token_ids(llm, 20, seed=442), GREEDY))
    done = run(llm, max_steps=200)
    assert "small" in done and done["small"].finish_reason == FinishReason.LENGTH, "small waited behind big"
    if "big" in done:
        assert done["big"].finish_reason == FinishReason.ERROR and "pinned" in (done["big"].error or "")
    assert not engine.has_unfinished_requests()


# --- eviction -------------------------------------------------------------------------------------
def test_eviction_takes_leaves_first_and_never_orphans_a_chunk():
    llm = make(max_cache_bytes=48 * BYTES_PER_BLOCK)
    prompts = [corpus_token_ids(llm, 4 * CHUNK + 3, seed=450 + i) for i in range(2)]
    llm.generate(prompts, GREEDY)
    store = llm.engine.store
    store.evict(2)  # one chunk's blocks
    hashes = chain(llm, prompts[0])
    assert hashes[0] in store, "a document's root chunk was evicted while its children stay cached"
    assert_reachable(llm, prompts)
    for i in range(8):  # pressure: many more prompts than the pool holds
        llm.generate([corpus_token_ids(llm, 4 * CHUNK + 3, seed=460 + i)], GREEDY)
        assert_reachable(llm, prompts)


# --- the content index ----------------------------------------------------------------------------
def test_the_content_index_is_bounded_by_the_store():
    llm = make()
    any_reuse = ReuseOptions(reuse="any", recompute_strategy="none")
    for i in range(4):
        llm.generate([corpus_token_ids(llm, 4 * CHUNK + 3, seed=470 + i)], GREEDY, reuse=any_reuse)
    index = llm.engine.reuse.matcher.index
    assert len(index) > 0
    llm.engine.store.evict(10**6)
    assert len(index) == 0, "entries of evicted chunks stay in the index"


def test_prefix_only_requests_are_not_content_indexed():
    llm = make()
    llm.generate([corpus_token_ids(llm, 4 * CHUNK + 3, seed=480)], GREEDY)  # the server default: prefix
    assert len(llm.engine.reuse.matcher.index) == 0


def test_warm_without_content_reuse_keeps_no_tail_pieces(monkeypatch: pytest.MonkeyPatch):
    from kvserve.reuse import build as content_reuse

    monkeypatch.setattr(content_reuse, "check_content_reuse", lambda model: (None, "off for this test"))
    llm = make()
    assert not llm.stats().content_reuse.available
    result = llm.warm(corpus_token_ids(llm, 2 * CHUNK + 10, seed=490), pin=True)
    assert result.num_new_chunks == 2 and len(llm.engine.store) == 2, "a tail nobody can use"


def test_cached_tail_pieces_hold_no_full_precision_shadow():
    """KIVI keeps a block's K in full precision until the block fills; a warmed text's tail ends
    mid-block and never fills, so unsealed it would hold a shadow (uncounted by the budget) for as long
    as it stays cached."""
    llm = make(kv_cache_dtype="int8")
    for i in range(6):
        llm.warm(corpus_token_ids(llm, 2 * CHUNK + 7 + i, seed=500 + i), pin=False)
    assert sum(layer.shadow_bytes() for layer in llm.engine.layers) == 0  # type: ignore[attr-defined]
    doc = corpus_token_ids(llm, 2 * CHUNK + 9, seed=500 + 2)
    prompt = corpus_token_ids(llm, CHUNK, seed=510) + doc + [5, 6]
    (out,) = llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any", recompute_strategy="none"))
    assert out.num_approx_cached_tokens == 2 * CHUNK, "the warmed text is still found and reused"
