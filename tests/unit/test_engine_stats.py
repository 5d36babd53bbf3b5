"""EngineStats over a real tiny-random-llama engine, and the offline API's request handling (n > 1,
warm, all-or-none intake) built on kvserve.request's one fan-out and one warm request."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.stats import EngineStats, num_evictable_blocks
from kvserve.errors import InvalidRequestError

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
    assert num_evictable_blocks(engine) == after.pool.num_evictable_blocks
    engine.check_integrity()


def test_blocks_shared_with_a_running_request_are_not_evictable(llm: LLM) -> None:
    from kvserve.request import Request

    engine = llm.engine
    prefix = _ids(3000, 2 * CHUNK)
    llm.warm(prefix, pin=False)
    evictable = num_evictable_blocks(engine)
    engine.add_request(Request("user", prefix + [7, 8], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()  # admitted: its prefix chunks are in use
    in_use = 2 * CHUNK // engine.pool.block_size
    assert num_evictable_blocks(engine) == evictable - in_use
    engine.abort_request("user")
    while engine.has_unfinished_requests():
        engine.step()
    assert num_evictable_blocks(engine) == evictable


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
