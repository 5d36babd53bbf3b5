"""EngineStats over a real tiny-random-llama engine, and the offline API's request handling (n > 1,
warm, all-or-none intake) built on kvserve.request's one fan-out and one warm request."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.stats import EngineStats
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.stats import num_evictable_blocks

CHUNK = 32
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-random-llama", chunk_size=CHUNK, max_cache_bytes=16_000_000)


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_evictable_blocks_count_as_free_in_usage(llm: LLM) -> None:
    engine = llm.engine
    before = llm.stats()
    llm.warm(_ids(1000, 4 * CHUNK), pin=False)
    after = llm.stats()
    blocks = 4 * CHUNK // engine.pool.block_size
    assert after.pool.num_used_blocks == before.pool.num_used_blocks + blocks
    assert after.pool.num_evictable_blocks == before.pool.num_evictable_blocks + blocks
    assert after.pool.usage == pytest.approx(before.pool.usage)  # free for new work
    llm.warm(_ids(1000, 4 * CHUNK), pin=True)
    pinned = llm.stats()
    assert pinned.pool.num_evictable_blocks == before.pool.num_evictable_blocks
    assert pinned.pool.usage == pytest.approx(before.pool.usage + blocks / pinned.pool.num_blocks)
    assert llm.unpin(_ids(1000, 4 * CHUNK)) == 4
    assert num_evictable_blocks(engine.pool, engine.store) == after.pool.num_evictable_blocks
    engine.check_integrity()


def test_blocks_shared_with_a_running_request_are_not_evictable(llm: LLM) -> None:
    from kvserve.request import Request

    engine = llm.engine
    prefix = _ids(3000, 2 * CHUNK)
    llm.warm(prefix, pin=False)
    evictable = num_evictable_blocks(engine.pool, engine.store)
    engine.add_request(Request("user", prefix + [7, 8], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()  # admitted: its prefix chunks are in use
    in_use = 2 * CHUNK // engine.pool.block_size
    assert num_evictable_blocks(engine.pool, engine.store) == evictable - in_use
    engine.abort_request("user")
    while engine.has_unfinished_requests():
        engine.step()
    assert num_evictable_blocks(engine.pool, engine.store) == evictable


def test_stats_value_and_its_dict(llm: LLM) -> None:
    llm.generate([_ids(5000, 40)], GREEDY)
    s = llm.stats()
    assert isinstance(s, EngineStats) and s.model == "tiny-random-llama"
    assert s.num_generated_tokens >= 3 and s.num_running == 0 and s.num_waiting == 0
    assert s.hit_rate == (s.num_hit_tokens / s.num_query_tokens if s.num_query_tokens else 0.0)
    d = s.as_dict()
    assert d["pool"]["num_evictable_blocks"] == s.pool.num_evictable_blocks
    assert d["num_evictions"] == s.store.num_evicted_chunks and d["hit_rate"] == s.hit_rate
    assert llm.engine.stats() == s  # Engine.stats() is the same value


def test_n_samples_use_consecutive_seeds(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=11, n=2)
    two = llm.generate([_ids(200, 9)], params)
    one = [
        llm.generate([_ids(200, 9)], SamplingParams(max_tokens=4, temperature=1.0, seed=s))[0]
        for s in (11, 12)
    ]
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_a_refused_prompt_leaves_nothing_running(llm: LLM) -> None:
    """generate() is all or none: when a later prompt is refused, the ones already added are
    aborted (they used to stay in the engine and be computed by the next call)."""
    engine = llm.engine
    too_long = _ids(100, engine.info.max_model_len + 5)
    with pytest.raises(InvalidRequestError):
        llm.generate([_ids(300, 20), too_long], GREEDY)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    (out,) = llm.generate([_ids(300, 20)], GREEDY)
    assert len(out.token_ids) == 3


def test_occupancy_by_state_and_the_top_chunks(llm: LLM) -> None:
    """The dashboard's pool states sum to the pool; each is the count it names. The chunk table ranks
    by reuse and carries hashes and counters only."""
    from kvserve.request import Request

    engine, per_chunk = llm.engine, CHUNK // llm.engine.pool.block_size
    pinned_doc, cold_doc = _ids(5000, 2 * CHUNK), _ids(6000, 3 * CHUNK)
    llm.warm(pinned_doc, pin=True)
    llm.warm(cold_doc, pin=False)
    for i in range(3):  # the cold document's first chunk is reused three times
        llm.generate([cold_doc[:CHUNK] + [9, i]], GREEDY)
    engine.add_request(Request("hot", _ids(7000, 2 * CHUNK), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    s = llm.stats()
    occ = s.occupancy_blocks
    assert sum(occ.values()) == s.pool.num_blocks and occ["free"] == s.pool.num_free_blocks
    assert occ["pinned"] == s.store.num_pinned_blocks >= 2 * per_chunk
    assert occ["evictable"] == s.pool.num_evictable_blocks >= 2 * per_chunk  # the cold document's tail
    assert occ["in_use"] >= 2 * per_chunk  # the running request's prompt
    top = s.store.top_chunks
    assert 0 < len(top) <= 10 and [c.num_hits for c in top] == sorted((c.num_hits for c in top), reverse=True)
    first = top[0]
    assert first.num_hits >= 3 and first.depth == 0 and first.prefix_tokens == CHUNK and not first.pinned
    assert len(first.chunk_hash) == 16 and int(first.chunk_hash, 16) >= 0
    assert first.tier == "hot" and first.origin == "computed" and first.last_used <= time.monotonic()
    engine.abort_request("hot")
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.unpin(pinned_doc) == 2
    engine.check_integrity()


def test_background_sequences_are_counted_apart_from_requests() -> None:
    """Issue 62.2: queue.running (kvserve:num_requests_running) counted the audits' full recomputes as
    requests; they are their own numbers, running (admitted in idle steps) and waiting."""
    from kvserve.request import Request
    from kvserve.stat_table import stat_sections
    from tests.integration.test_repair_in_batch import NONE, PARAMS3, make, rag_prompt, warmed

    llm = make(audit_rate=1.0)
    engine = llm.engine
    docs = warmed(llm)
    for seed, order in enumerate(([2, 0, 1], [1, 2, 0])):  # served from content hits: two audits wait
        llm.generate([rag_prompt(llm, docs, order, seed=seed)], PARAMS3, reuse=NONE)
    s = llm.stats()
    assert (s.num_running, s.num_waiting, s.num_background_running, s.num_background_waiting) == (0, 0, 0, 2)
    engine.step()  # idle: the first audit is admitted
    s = llm.stats()
    assert (s.num_running, s.num_background_running, s.num_background_waiting) == (0, 1, 1)
    engine.add_request(Request("user", _ids(9000, 40), PARAMS3))
    engine.step()
    queue = stat_sections(llm.stats())["queue"]
    assert queue["running"] == 1 and queue["waiting"] == 0
    assert queue["background_running"] == 1 and queue["background_waiting"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    s = llm.stats()
    assert (s.num_running, s.num_background_running, s.num_background_waiting) == (0, 0, 0)
    engine.check_integrity()
