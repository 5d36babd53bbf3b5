"""Admission never waits for memory that nothing will free (found by issue 62's soak with the hot-prefix
flood: six requests waited 180 s at 0 % CPU, nothing running, 58 of 122 blocks free).

A content-reuse repair allocates all its blocks at admission and holds its hits' source chunks. Eviction
takes leaves first, so the sources' ancestors cannot be evicted either; `can_ever_fit` counted the pool
minus pins and sources, said "it fits once memory frees", and the scheduler waited, admitting nothing
younger, while nothing ran that could free a block; and a repair larger than the pool beside its pins was
refused (a 500) although the prompt fits computed exactly. Now a repair whose memory is not there is
computed exactly (a sliced prefill needs a step's blocks, not the whole prompt's), and a sequence that
cannot be admitted while nothing runs is refused with the reason instead of waiting forever."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import Request, ReuseOptions
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
OPTS = ReuseOptions(reuse="any", recompute_strategy="selective")


def make(num_blocks: int | None, **kw) -> LLM:
    per_block = (
        16 * 1024
    )  # tiny-random-llama in fp32 (the suite pins --dtype auto to it): 1 KiB of KV a token
    size = {"max_cache_bytes": num_blocks * per_block} if num_blocks else {"max_cache_bytes": 50_000_000}
    return LLM(
        model="tiny-random-llama", chunk_size=CHUNK, pieces="fixed", reuse_min_saving=-10.0, **size, **kw
    )


@pytest.mark.parametrize(
    "num_blocks, was",
    [(30, "waited forever: 'fits once memory frees', nothing running"), (24, "refused: 'can never fit'")],
)
def test_a_repair_whose_blocks_are_not_there_is_computed_exactly(num_blocks: int, was: str) -> None:
    cold = make(None, enable_prefix_caching=False)
    docs = [corpus_token_ids(cold, 3 * CHUNK, seed=70 + i) for i in range(2)]
    carrier = corpus_token_ids(cold, 2 * CHUNK, seed=80) + docs[0] + docs[1]  # both documents inside it
    prompt = (
        corpus_token_ids(cold, 2 * CHUNK, seed=81) + docs[1] + docs[0] + corpus_token_ids(cold, 7, seed=82)
    )
    (want,) = cold.generate([prompt], GREEDY)

    llm = make(num_blocks)
    pool = llm.engine.pool.num_blocks
    # the repair takes 17 new blocks and holds 10 of sources: at 30 that "fits" (but not beside the
    # carrier's unevictable ancestors), at 24 never; the exact path needs 17 blocks at most
    assert pool == num_blocks, pool
    llm.generate([carrier], GREEDY, reuse=OPTS)  # its chunks: the sources and their (unevictable) ancestors
    engine = llm.engine
    engine.add_request(Request("rag", prompt, GREEDY, reuse=OPTS))
    outputs = []
    for _ in range(200):  # the old scheduler admitted nothing, ever
        outputs += [o for o in engine.step() if o.finished]
        if outputs:
            break
    assert outputs, (
        f"not admitted: {len(engine.scheduler.waiting)} waiting, {len(engine.scheduler.running)} running"
    )
    (out,) = outputs
    assert out.error is None and out.token_ids == want.token_ids
    engine.check_integrity()
