"""The pool keeps only the window on sliding-window layers (kvcache/layout.py), in a served model:
tiny-random-gemma3 (4 layers, one global; a 24-token window), so one global and three sliding layer
groups of one layer each.

- while a request runs, its sliding groups hold only the blocks its next row's window reads;
- a pool too small for every layer's KV of a prompt serves it by the window, with the answer of a
  pool that holds it all;
- a prefix hit ends where the sliding parts before it left the pool, and the answer does not change.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError
from kvserve.kvcache.layout import KVLayout
from tests.integration.helpers import corpus_token_ids, generate_with_logits

MODEL = "tiny-random-gemma3"
BS, CHUNK, STEP = 16, 32, 64
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TOL = 1e-4


def make(**overrides: object) -> LLM:
    common = dict(
        model=MODEL, chunk_size=CHUNK, block_size=BS, max_num_batched_tokens=STEP, max_cache_bytes=20_000_000
    )
    return LLM(**{**common, **overrides})  # type: ignore[arg-type]


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    (out,), (logits,) = generate_with_logits(llm, [prompt], GREEDY)
    return out.token_ids, logits


def layout(llm: LLM) -> KVLayout:
    kv_layout = llm.engine.kv.layout
    assert kv_layout is not None and kv_layout.windowed and kv_layout.num_groups == 4
    return kv_layout


def test_a_running_request_holds_only_the_window_of_its_sliding_layers():
    llm = make(enable_prefix_caching=False)
    kv = llm.engine.kv
    seen: list[tuple[int, int, list[list[int]]]] = []
    slide = kv.slide

    def record(request_id: str, num_computed: int) -> None:
        slide(request_id, num_computed)
        tables = kv.block_tables(request_id)
        seen.append((num_computed, sum(b >= 0 for t in tables for b in t), tables))

    kv.slide = record  # type: ignore[method-assign]
    run(llm, corpus_token_ids(llm, 300, seed=1))
    assert len(seen) >= 5 + 5  # 300 prompt tokens in 64-row slices, then the decode steps
    for num_computed, held, tables in seen:
        assert held == layout(llm).held_blocks(num_computed, BS)
        for group, table in zip(layout(llm).groups, tables, strict=True):
            first = max(0, num_computed - 24 + 1) // BS if group.window else 0
            assert table[:first] == [-1] * first and -1 not in table[first:]
    # 305 tokens computed: 20 global blocks, and the next row reads 282..305: blocks 17-19 of each sliding group
    assert seen[-1][1] == 20 + 3 * 3
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_pool_too_small_for_every_layer_serves_by_the_window():
    big = make()
    info = big.engine.info
    page_bytes = info.bytes_per_token * BS // info.num_layers  # one layer per group
    prompt = corpus_token_ids(big, 400, seed=2)
    need_every_layer = -(-(400 + 6) // BS) * info.num_layers  # 104 blocks
    small = make(max_cache_bytes=int(60 * page_bytes))
    assert small.engine.kv.pool.num_blocks == 60 < need_every_layer
    ids, logits = run(small, prompt)
    want_ids, want_logits = run(big, prompt)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=0)


def test_a_hit_ends_where_the_sliding_parts_left_and_the_answer_stays():
    cached, off = make(), make(enable_prefix_caching=False)
    prompt = corpus_token_ids(cached, 6 * CHUNK + 5, seed=3)
    want_ids, want_logits = run(off, prompt)
    stats = cached.engine.stats
    kv = cached.engine.kv

    def hits_of_a_run() -> int:
        before = stats().num_hit_tokens
        ids, logits = run(cached, prompt)
        assert ids == want_ids
        torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=0)
        return stats().num_hit_tokens - before

    assert hits_of_a_run() == 0
    assert hits_of_a_run() == 6 * CHUNK  # every chunk, the last with its sliding part
    # a full pool drops the oldest sliding parts first: a hit of every chunk reads only the last's
    assert kv.store.drop_windows(5 * 3 * 2, keep=set()) == 30
    assert [bool(c.window_blocks) for c in sorted(kv.store.chunks(), key=lambda c: c.depth)] == [
        False
    ] * 5 + [True]
    assert hits_of_a_run() == 6 * CHUNK
    kv.store.drop_windows(10**6, keep=set())
    assert all(not c.window_blocks for c in kv.store.chunks())
    assert hits_of_a_run() == 0  # the next row would read KV that left: computed again
    assert hits_of_a_run() == 6 * CHUNK  # and the recomputation gave the chunks their sliding parts back
    kv.check_integrity([])


def test_the_cold_tier_is_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="sliding-window layers.*use the disk or Redis tier"):
        make(kv_cold_bytes=10_000_000)


def test_preempted_requests_answer_as_alone():
    big = make(enable_prefix_caching=False)
    info = big.engine.info
    page_bytes = info.bytes_per_token * BS // info.num_layers
    small = make(max_cache_bytes=int(60 * page_bytes), max_num_seqs=2)
    prompts = [corpus_token_ids(big, 400, seed=10 + i) for i in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in big.generate(prompts, params)]
    small.engine.check_integrity_each_step = True
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert got == want
    assert small.engine.scheduler.num_preemptions > 0  # the two did not fit side by side


def test_a_hit_inside_a_chunk_takes_the_window_of_that_chunk():
    cached, off = make(), make(enable_prefix_caching=False)
    base = corpus_token_ids(cached, 6 * CHUNK + 5, seed=4)
    run(cached, base)
    prompt = base[: 4 * CHUNK + 20] + corpus_token_ids(cached, 10, seed=5)  # 20 tokens into chunk 4
    (out,), (logits,) = generate_with_logits(cached, [prompt], GREEDY)
    want_ids, want_logits = run(off, prompt)
    assert out.num_cached_tokens == 4 * CHUNK + 16  # chunk 4's first block, with its sliding part
    assert out.token_ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=0)
