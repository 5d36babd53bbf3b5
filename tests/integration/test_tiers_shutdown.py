"""The shutdown write (tiers/shutdown_write.py) through the engine: closing an engine with a
disk tier under --kv-disk-write evicted writes the hot chunks the disk lacks, most valuable first
(the eviction policy's value, each chunk after its parent), within kv_disk_bytes and
kv_disk_shutdown_write_s, and a restart on the same directory finds them with the exact answer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache.hashing import chunk_prefix_hashes, root_hash
from kvserve.tiers import shutdown_write
from kvserve.tiers.disk import DiskTier
from tests.integration.helpers import corpus_token_ids, generate_with_logits

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHUNK = 32
COMMON = dict(model="tiny-random-llama", attention_backend="reference", chunk_size=CHUNK, block_size=16)


def make(tmp: Path, **overrides) -> LLM:
    return LLM(**{**COMMON, "max_cache_bytes": 50_000_000, "kv_disk_dir": str(tmp), **overrides})


def run(llm: LLM, prompt: list[int]):
    outs, logits = generate_with_logits(llm, [prompt], GREEDY)
    return outs[0], logits[0]


def disk_of(llm: LLM) -> DiskTier:
    assert llm.engine.tiers is not None and llm.engine.tiers.tiers.disk is not None
    return llm.engine.tiers.tiers.disk


def names(llm: LLM, prompt: list[int], num_chunks: int) -> list[str]:
    """The disk tier's file names of the prompt's first `num_chunks` chunks, in prompt order."""
    assert llm.engine.tiers is not None
    hashes = chunk_prefix_hashes(prompt, CHUNK, root_hash(llm.engine.info.namespace, None))
    return [llm.engine.tiers.tiers.key(h).name for h in hashes[:num_chunks]]


def record_puts(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, each: Callable[[], object] = lambda: None
) -> list[str]:
    """The names the disk tier's `put` is called with, in order (calling `each` before each put)."""
    disk, calls = disk_of(llm), []
    put = disk.put

    def recording_put(key, token_ids_hash, payload):
        calls.append(key.name)
        each()
        return put(key, token_ids_hash, payload)

    monkeypatch.setattr(disk, "put", recording_put)
    return calls


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(**COMMON, max_cache_bytes=50_000_000, enable_prefix_caching=False)


def test_a_served_prompt_survives_a_restart(tmp_path, reference):
    prompt = corpus_token_ids(reference, 3 * CHUNK + 5, seed=101)
    want, want_logits = run(reference, prompt)
    first = make(tmp_path)  # kv_disk_write="evicted": nothing evicted, nothing warmed
    run(first, prompt)
    first.engine.flush_tiers()
    assert not list(tmp_path.glob("*.kv"))  # before this fix, close() wrote nothing either
    first.close()
    assert sorted(p.stem for p in tmp_path.glob("*.kv")) == sorted(names(first, prompt, 3))

    second = make(tmp_path)
    out, logits = run(second, prompt)
    assert out.token_ids == want.token_ids and out.num_cached_tokens == 3 * CHUNK
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    disk_of(second).check_integrity()
    second.close()


@pytest.mark.parametrize("policy", ["lru_freq", "lru"])
def test_the_order_is_the_policys_value_with_each_chunk_after_its_parent(
    tmp_path, reference, monkeypatch, policy
):
    """x is used three times, then y once. lru_freq keeps x (more uses), lru keeps y (more recent);
    within a prompt the deeper chunk is the more recent one, yet its parent is written first."""
    x = corpus_token_ids(reference, 3 * CHUNK + 3, seed=111)
    y = corpus_token_ids(reference, 3 * CHUNK + 3, seed=112)
    llm = make(tmp_path, eviction_policy=policy)
    for _ in range(3):
        run(llm, x)
    run(llm, y)
    puts = record_puts(llm, monkeypatch)
    llm.close()
    first, second = (x, y) if policy == "lru_freq" else (y, x)
    assert puts == names(llm, first, 3) + names(llm, second, 3)


def test_kv_disk_bytes_keeps_the_most_valuable_chunks(tmp_path, reference, monkeypatch):
    x = corpus_token_ids(reference, 2 * CHUNK + 3, seed=121)
    y = corpus_token_ids(reference, 2 * CHUNK + 3, seed=122)
    z = corpus_token_ids(reference, 2 * CHUNK + 3, seed=123)
    probe = make(tmp_path / "probe", kv_disk_write="all")
    run(probe, x)
    probe.close()
    entry = next((tmp_path / "probe").glob("*.kv")).stat().st_size
    directory = tmp_path / "kv"
    llm = make(directory, kv_disk_bytes=int(3.5 * entry))
    llm.warm(z[:CHUNK])  # written through at once: on disk, hot, pinned, so counted first
    for _ in range(3):
        run(llm, x)
    run(llm, y)
    puts = record_puts(llm, monkeypatch)
    llm.close()
    assert puts == names(llm, x, 2)  # z's chunk was on disk already; y's are over the bytes
    kept = sorted(p.stem for p in directory.glob("*.kv"))
    assert kept == sorted(names(llm, x, 2) + names(llm, z, 1))
    assert sum(p.stat().st_size for p in directory.glob("*.kv")) <= 3.5 * entry

    restarted = make(directory, kv_disk_bytes=int(3.5 * entry))
    assert run(restarted, x)[0].num_cached_tokens == 2 * CHUNK
    out, _ = run(restarted, y)
    assert out.num_cached_tokens == 0 and out.token_ids == run(reference, y)[0].token_ids
    disk_of(restarted).check_integrity()
    restarted.close()


class _Clock:
    """shutdown_write's `time`: a monotonic clock that moves only when told (each recorded put)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s

    def advance(self) -> None:
        self.now_s += 0.1


def test_the_time_cap_stops_the_write_and_the_log_shows_progress(tmp_path, reference, monkeypatch, caplog):
    """The cap is checked before each chunk: with every put taking 0.1 s of a 0.35 s cap, puts start
    at 0, 0.1, 0.2 and 0.3 s, and at 0.4 s the other 4 of the 8 chunks are left. The clock is
    shutdown_write's own, moved by the puts, so the count does not depend on the machine's speed
    (issue 62.6: this asserted `1 <= len(puts) <= 4 < 8` on wall time)."""
    prompts = [corpus_token_ids(reference, 2 * CHUNK + 3, seed=131 + i) for i in range(4)]
    llm = make(tmp_path, kv_disk_shutdown_write_s=0.35)
    for p in prompts:
        run(llm, p)
    clock = _Clock()
    puts = record_puts(llm, monkeypatch, each=clock.advance)
    monkeypatch.setattr(shutdown_write, "time", clock)
    monkeypatch.setattr(shutdown_write, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="kvserve.tiers"):
        llm.close()
    assert len(puts) == 4
    assert len(list(tmp_path.glob("*.kv"))) == 4
    messages = [r.getMessage() for r in caplog.records]
    assert any("shutdown write:" in m and "chunks done" in m for m in messages), messages
    done = [m for m in messages if "shutdown write done" in m]
    assert len(done) == 1 and "4 chunks written" in done[0], messages
    assert "4 left at the time cap" in done[0], messages
    disk_of(llm).check_integrity()


def test_zero_turns_it_off_and_a_busy_engine_is_not_read(tmp_path, reference):
    prompt = corpus_token_ids(reference, 2 * CHUNK + 3, seed=141)
    off = make(tmp_path / "off", kv_disk_shutdown_write_s=0)
    run(off, prompt)
    off.close()
    busy = make(tmp_path / "busy")
    run(busy, prompt)
    busy.engine.close(write_hot=False)  # AsyncEngine.shutdown when its step thread did not stop
    assert not list(tmp_path.rglob("*.kv"))
