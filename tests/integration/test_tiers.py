"""The disk tier wired into the engine: chunks written, found again after a restart (a new engine on
the same directory), loaded by the loader thread, and exactly what the hot pool alone gives; damaged,
truncated and foreign entries are detected, counted, removed and recomputed."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.tiers.entry import TierKey, encode_entry
from tests.integration.helpers import corpus_token_ids, generate_with_logits

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHUNK = 32
COMMON = dict(model="tiny-random-llama", attention_backend="reference", chunk_size=CHUNK, block_size=16)


def make(tmp: Path | None = None, **overrides) -> LLM:
    tiers = {"kv_disk_dir": str(tmp)} if tmp is not None else {}
    return LLM(**{**COMMON, "max_cache_bytes": 50_000_000, **tiers, **overrides})


def tier(llm: LLM, name: str):
    return next(t for t in llm.engine.stats().tiers if t.tier == name)


def run(llm: LLM, prompt: list[int]):
    outs, logits = generate_with_logits(llm, [prompt], GREEDY)
    return outs[0].token_ids, logits[0]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return make(enable_prefix_caching=False)


@pytest.mark.parametrize("codec", ["auto", "int4"])
def test_restart_finds_chunks_written_through_and_answers_exactly(tmp_path, reference, codec):
    prompt = corpus_token_ids(reference, 5 * CHUNK + 9, seed=11)
    want_ids, want_logits = run(make(kv_cache_dtype=codec, enable_prefix_caching=False), prompt)
    with make(tmp_path, kv_disk_write="all", kv_cache_dtype=codec) as first:  # closes: writes stored
        assert run(first, prompt)[0] == want_ids
    assert len(list(tmp_path.glob("*.kv"))) == 5

    second = make(tmp_path, kv_disk_write="all", kv_cache_dtype=codec)  # the restart
    ids, logits = run(second, prompt)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    disk = tier(second, "disk")
    assert (disk.hits, disk.loads, disk.corruptions) == (5, 5, 0)
    s = second.engine.stats()
    assert s.num_hit_tokens == 5 * CHUNK  # the first request after the restart was warm
    second.engine.check_integrity()
    second.engine.close()


def test_evicted_chunks_come_back_from_disk(tmp_path, reference):
    """A pool of a few chunks: the first prompt's chunks are evicted by the second's, written to
    disk, and loaded back for the first prompt's repeat."""
    small = dict(max_cache_bytes=14 * 16 * 2 * 2 * 4 * 16 * 4)  # about 14 blocks of tiny-random-llama
    a = corpus_token_ids(reference, 4 * CHUNK + 3, seed=21)
    b = corpus_token_ids(reference, 4 * CHUNK + 3, seed=22)
    llm = make(tmp_path, **small)
    pool_blocks = llm.engine.pool.num_blocks
    assert pool_blocks < 20, pool_blocks  # else nothing is evicted: adjust the bytes above
    want = run(reference, a)
    run(llm, a)
    run(llm, b)
    assert llm.engine.store.num_evicted_chunks > 0
    assert llm.engine.tiers is not None and llm.engine.tiers.tiers.flush()
    assert tier(llm, "disk").writes > 0
    ids, logits = run(llm, a)
    assert ids == want[0]
    torch.testing.assert_close(logits, want[1], atol=1e-4, rtol=0)
    assert tier(llm, "disk").loads > 0
    llm.engine.close()


def test_warmed_text_survives_a_restart_with_the_evicted_policy(tmp_path, reference):
    text = corpus_token_ids(reference, 4 * CHUNK, seed=31)
    first = make(tmp_path)  # kv_disk_write="evicted": warms are still written through
    first.warm(text)
    first.engine.close()
    assert len(list(tmp_path.glob("*.kv"))) == 4
    second = make(tmp_path)
    prompt = text + corpus_token_ids(reference, 10, seed=32)
    ids, _ = run(second, prompt)
    assert ids == run(reference, prompt)[0]
    assert second.engine.stats().num_hit_tokens == 4 * CHUNK
    second.engine.close()


def test_damaged_truncated_and_foreign_entries_are_counted_removed_and_recomputed(tmp_path, reference):
    prompt = corpus_token_ids(reference, 5 * CHUNK + 1, seed=41)
    want_ids, want_logits = run(reference, prompt)
    first = make(tmp_path, kv_disk_write="all")
    run(first, prompt)
    first.engine.close()
    assert len(list(tmp_path.glob("*.kv"))) == 5
    # damage chunk 2 (a flipped payload byte), truncate chunk 3, replace chunk 4 with another model's entry
    by_depth = _files_by_depth(first, prompt, tmp_path)
    data = bytearray(by_depth[2].read_bytes())
    data[len(data) // 2] ^= 0x40
    by_depth[2].write_bytes(bytes(data))
    by_depth[3].write_bytes(by_depth[3].read_bytes()[:-100])
    key4 = _key(first, prompt, 4)
    foreign = TierKey("0" * 16, key4.codec, key4.namespace, key4.chunk_hash)
    by_depth[4].write_bytes(encode_entry(foreign, b"\0" * 32, b"x" * 64))

    # each restart reads up to the first bad entry, removes it and recomputes from there (rewriting
    # the removed chunk); the next restart gets one chunk further
    for loads, reason in ((2, "checksum"), (3, "truncated"), (4, "other_model"), (5, None)):
        llm = make(tmp_path, kv_disk_write="all")
        ids, logits = run(llm, prompt)
        assert ids == want_ids
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
        assert tier(llm, "disk").loads == loads
        assert llm.engine.tiers is not None
        disk = llm.engine.tiers.tiers.disk
        assert disk is not None
        assert disk.stats().corruptions == ({reason: 1} if reason else {})
        llm.engine.close()


def test_a_disk_fault_costs_each_write_its_entry_and_logs_once(tmp_path, reference, caplog):
    """Issue 62.4: with the directory replaced by a file, DiskTier.put raised (its cleanup unlink
    too), so the tier writer dropped the rest of each batch with a traceback. Now every chunk's write
    is tried and counted, one warning is logged, and writes resume when the directory is back."""
    directory = tmp_path / "kv"
    llm = make(directory, kv_disk_write="all")
    directory.rmdir()
    directory.write_bytes(b"a file where the directory was")
    prompt = corpus_token_ids(reference, 5 * CHUNK + 1, seed=43)
    with caplog.at_level(logging.DEBUG, logger="kvserve.tiers"):
        assert run(llm, prompt)[0] == run(reference, prompt)[0]
        assert llm.engine.flush_tiers()
    assert tier(llm, "disk").write_errors == 5
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "disk tier: writing" in warnings[0], warnings
    directory.unlink()
    directory.mkdir()
    run(llm, corpus_token_ids(reference, 2 * CHUNK + 1, seed=44))
    assert llm.engine.flush_tiers()
    assert len(list(directory.glob("*.kv"))) == 2 and tier(llm, "disk").write_errors == 5
    llm.engine.close()


def _key(llm: LLM, prompt: list[int], depth: int) -> TierKey:
    from kvserve.kvcache.hashing import chunk_prefix_hashes, root_hash

    engine = llm.engine
    assert engine.tiers is not None
    hashes = chunk_prefix_hashes(prompt, CHUNK, root_hash(engine.info.namespace, None))
    return engine.tiers.tiers.key(hashes[depth])


def _files_by_depth(llm: LLM, prompt: list[int], directory: Path) -> dict[int, Path]:
    return {d: directory / f"{_key(llm, prompt, d).name}.kv" for d in range(5)}


# --- the cold area: demotion frees hot blocks, promotion gives what the cold codec gives ------------


def _roundtrip_in_place(llm: LLM, block_ids: list[int], codec: str) -> None:
    """Replace the KV of `block_ids` in every layer by what `codec` stores of it (encode, decode),
    through a fresh storage of that codec: the reference for a promoted chunk."""
    from kvserve.kvcache.block_pool import slot_mapping
    from kvserve.kvcache.quantized_storage import create_layer_kv

    ids = torch.tensor(block_ids)
    for idx, layer in enumerate(llm.engine.layers):
        k, v = layer.gather(ids)
        n, bs = len(block_ids), layer.block_size
        coder = create_layer_kv(
            codec, n, bs, layer.num_kv_heads, layer.head_dim, layer.compute_dtype, "cpu", idx
        )
        rows = torch.arange(n * bs)
        coder.write(rows, k.reshape(n * bs, *k.shape[2:]), v.reshape(n * bs, *v.shape[2:]))
        ck, cv = coder.gather(torch.arange(n))
        slots = slot_mapping(ids, rows, bs)
        layer.write(slots, ck.reshape(n * bs, *ck.shape[2:]), cv.reshape(n * bs, *cv.shape[2:]))


def test_demotion_frees_hot_blocks_and_promotion_equals_the_cold_codec(reference):
    prompt = corpus_token_ids(reference, 4 * CHUNK + 5, seed=51)
    llm = make(kv_cold_bytes=20_000_000)
    engine = llm.engine
    assert engine.tiers is not None
    _, hot_logits = run(llm, prompt)
    free_before = engine.pool.num_free_blocks
    assert engine.tiers.tiers.demote_idle(time.monotonic() + 1) == 4
    assert engine.tiers.tiers.flush()  # the demoter thread encodes
    assert engine.pool.num_free_blocks == free_before + 4 * CHUNK // 16  # really freed
    cold = tier(llm, "cold")
    assert cold.chunks == 4 and cold.bytes > 0
    ids, logits = run(llm, prompt)
    assert tier(llm, "cold").loads == 4 and len(engine.tiers.tiers.cold or []) == 0
    assert engine.stats().num_hit_tokens == 4 * CHUNK  # the first run computed everything

    # the reference: the same chunks, hot, with their KV passed through the cold codec in place
    ref = make()
    run(ref, prompt)
    chunks = sorted(ref.engine.store.chunks(), key=lambda c: c.depth)
    cold_codec = engine.info.kv_cold_codec  # --kv-cold-codec auto: the measured choice (quant/choice.py)
    assert cold_codec is not None and cold_codec == engine.tiers.tiers.cold.codec
    for chunk in chunks:
        _roundtrip_in_place(ref, chunk.block_ids, cold_codec)
    ref.engine.check_integrity()
    want_ids, want_logits = run(ref, prompt)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=0, rtol=0)
    # and it is an approximation of the hot answer, not the hot answer itself
    assert not torch.equal(logits, hot_logits)
    engine.check_integrity()


def test_promoted_chunks_and_their_descendants_never_reach_the_disk_tier(tmp_path, reference):
    prompt = corpus_token_ids(reference, 3 * CHUNK + 5, seed=61)
    llm = make(tmp_path, kv_cold_bytes=20_000_000, kv_disk_write="all")
    engine = llm.engine
    assert engine.tiers is not None
    run(llm, prompt)
    engine.tiers.tiers.flush()
    assert len(list(tmp_path.glob("*.kv"))) == 3
    engine.tiers.tiers.demote_idle(time.monotonic() + 1)
    engine.tiers.tiers.flush()
    for f in tmp_path.glob("*.kv"):
        f.unlink()
    longer = prompt[: 3 * CHUNK] + corpus_token_ids(reference, 2 * CHUNK + 3, seed=62)
    run(llm, longer)  # promotes 3 chunks, computes 2 more after them
    engine.tiers.tiers.flush()
    inexact = [c for c in engine.store.chunks() if not c.exact]
    assert len(inexact) == 5
    assert tier(llm, "disk").writes == 3  # only the first run's exact chunks were ever written


# --- the Redis tier: shared by engines, written on registration, read on a miss, survives outages -----


@pytest.fixture(scope="module")
def redis_server():
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        yield server


def test_a_second_engine_reads_what_the_first_wrote_to_redis(redis_server, reference):
    prompt = corpus_token_ids(reference, 4 * CHUNK + 7, seed=71)
    want_ids, want_logits = run(reference, prompt)
    writer = make(kv_redis_url=redis_server.url)
    assert run(writer, prompt)[0] == want_ids
    writer.engine.close()  # stores the queued writes
    assert tier(writer, "redis").writes == 4

    reader = make(kv_redis_url=redis_server.url)  # another process's view: an empty pool
    ids, logits = run(reader, prompt)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    r = tier(reader, "redis")
    assert (r.hits, r.loads, r.corruptions) == (4, 4, 0)
    reader.engine.close()


def test_redis_killed_mid_run_falls_back_to_compute_then_reconnects(redis_server, reference):
    prompts = [corpus_token_ids(reference, 3 * CHUNK + 2, seed=80 + i) for i in range(4)]
    want = [run(reference, p)[0] for p in prompts]
    llm = make(kv_redis_url=redis_server.url)
    assert run(llm, prompts[0])[0] == want[0]
    redis_server.kill()
    for p, w in zip(prompts[1:3], want[1:3], strict=True):  # Redis is gone: computed, no error
        assert run(llm, p)[0] == w
    assert llm.engine.tiers is not None
    llm.engine.tiers.tiers.flush()
    assert tier(llm, "redis").fallbacks + tier(llm, "redis").write_errors > 0
    redis_server.start()  # back, empty
    time.sleep(1.1)  # the tier retries after retry_after_s (1 s)
    assert run(llm, prompts[3])[0] == want[3]
    llm.engine.tiers.tiers.flush()
    redis = llm.engine.tiers.tiers.redis
    assert redis is not None and redis.stats().up
    reader = make(kv_redis_url=redis_server.url)
    ids, _ = run(reader, prompts[3])  # written after the restart, read by another engine
    assert ids == want[3]
    assert tier(reader, "redis").loads == 3
    llm.engine.close()
    reader.engine.close()


def test_a_chain_loaded_into_a_full_pool_does_not_evict_itself(tmp_path, reference):
    """The pool is full of a prompt used often (a high eviction priority); a prefix loaded from disk
    must evict that prompt's chunks to make room, not the chunk it loaded just before (a leaf with
    one use, until its child is inserted), which would cut the chain."""
    small = dict(max_cache_bytes=14 * 16 * 2 * 2 * 4 * 16 * 4)  # about 14 blocks: 7 chunks
    y = corpus_token_ids(reference, 4 * CHUNK + 3, seed=31)
    x = corpus_token_ids(reference, 4 * CHUNK + 3, seed=32)
    with make(tmp_path, kv_disk_write="all") as first:
        run(first, y)
    llm = make(tmp_path, kv_disk_write="all", **small)
    for _ in range(3):
        run(llm, x)
    hits = llm.engine.stats().num_hit_tokens
    ids, logits = run(llm, y)
    want = run(reference, y)
    assert ids == want[0]
    torch.testing.assert_close(logits, want[1], atol=1e-4, rtol=0)
    assert tier(llm, "disk").loads == 4
    assert llm.engine.stats().num_hit_tokens - hits == 4 * CHUNK
    llm.engine.check_integrity()
    llm.engine.close()


def test_weights_changed_in_the_same_directory_never_meet_their_old_kv(tmp_path, reference):
    """Issue 32.6: the namespace fingerprinted config.json, file names and sizes and the first MiB of
    each weight file, so a checkpoint updated in place (same directory, same name, same size) read the
    KV its predecessor left on disk. Every byte counts now."""
    import shutil

    from kvserve.models.loader import resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-random-llama"), model)
    disk = tmp_path / "disk"
    prompt = corpus_token_ids(reference, 4 * CHUNK + 5, seed=31)
    setup = dict(model=str(model), kv_disk_write="all")
    with make(disk, **setup) as first:
        run(first, prompt)
    with make(disk, **setup) as same:  # control: unchanged weights find their KV
        assert same.generate([prompt], GREEDY)[0].num_cached_tokens == 4 * CHUNK
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    assert len(data) > 2 << 20
    data[-64:] = bytes(255 - b for b in data[-64:])  # past the first MiB; same size
    weights.write_bytes(data)
    with make(disk, **setup) as updated:
        out = updated.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 0
        assert tier(updated, "disk").hits == 0


def test_stats_never_wait_on_a_slow_redis(redis_server, reference):
    """Issue 32.7: building the stats (the engine's thread, after its steps) asked Redis for INFO and
    DBSIZE every second, a round trip that a slow Redis stretches to its socket timeout; the ask now
    runs on a thread of its own and the stats show the last answer."""
    llm = make(kv_redis_url=redis_server.url)
    run(llm, corpus_token_ids(reference, 2 * CHUNK + 3, seed=91))
    tiers = llm.engine.tiers.tiers
    real_stats = tiers.redis.stats

    def slow_stats(with_sizes: bool = True):  # type: ignore[no-untyped-def]
        if with_sizes:
            time.sleep(1.0)
        return real_stats(with_sizes)

    tiers.redis.stats = slow_stats
    for _ in range(3):
        t0 = time.perf_counter()
        llm.engine.stats()
        assert time.perf_counter() - t0 < 0.5
    deadline = time.monotonic() + 5
    while tier(llm, "redis").chunks == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier(llm, "redis").chunks > 0  # the answer arrived from the asking thread
    llm.engine.close()


@pytest.mark.parametrize(
    "change", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "fp8_e4m3"}], ids=["dtype", "codec"]
)
def test_kv_from_another_dtype_or_codec_is_never_served_from_disk(tmp_path, reference, change):
    """Issue 32.6: the namespace (so every tier key) names the dtype and the codec beside the weights."""
    prompt = corpus_token_ids(reference, 3 * CHUNK + 4, seed=33)
    with make(tmp_path, kv_disk_write="all") as first:
        run(first, prompt)
    with make(tmp_path, kv_disk_write="all", **change) as other:
        assert other.generate([prompt], GREEDY)[0].num_cached_tokens == 0
        assert tier(other, "disk").hits == 0
