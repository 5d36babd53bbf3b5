"""The cold area: a demoted then promoted chunk reads back bitwise as an independent reference
(cold codec, then hot storage, each written fresh), the bytes it saves, its block accounting
against a real hot BlockPool, LRU eviction, the budget check, and what demotion and promotion cost
at SmolLM2-135M's shape."""

from __future__ import annotations

import time

import pytest
import torch

from kvserve.errors import ConfigError
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.quantized_storage import create_layer_kv
from kvserve.tiers.cold import ColdArea

NUM_LAYERS, H, D, BS, CHUNK_BLOCKS, HOT_BLOCKS = 4, 2, 64, 16, 8, 40


def make_hot(codec: str, dtype: torch.dtype, num_layers: int = NUM_LAYERS, h: int = H) -> list[LayerKV]:
    return [create_layer_kv(codec, HOT_BLOCKS, BS, h, D, dtype, layer_idx=i) for i in range(num_layers)]


def hot_pool(layers: list[LayerKV]) -> BlockPool:
    """A BlockPool over the layers that, like the engine's, tells storage when a block is freed."""
    pool = BlockPool(HOT_BLOCKS, BS)
    pool.on_free.extend(layer.on_block_freed for layer in layers)
    return pool


def slots_of(block_ids: list[int]) -> torch.Tensor:
    return (torch.tensor(block_ids)[:, None] * BS + torch.arange(BS)).flatten()


def fill(layers: list[LayerKV], block_ids: list[int], seed: int) -> None:
    """Random K/V (K with outlier channels, as real keys have) into every row of the blocks."""
    gen = torch.Generator().manual_seed(seed)
    for layer in layers:
        rows = len(block_ids) * BS
        k = torch.randn(rows, layer.num_kv_heads, D, generator=gen) * (1 + 4 * torch.rand(D, generator=gen))
        v = torch.randn(rows, layer.num_kv_heads, D, generator=gen)
        layer.write(slots_of(block_ids), k, v)


def gather(layer: LayerKV, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.gather(torch.tensor(block_ids))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: equal bits, not equal values."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def reference(
    cold_codec: str, hot_codec: str, dtype: torch.dtype, layer_idx: int, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [n, BS, H, D] written into a fresh cold-codec layer, gathered, written into a fresh hot
    layer, gathered."""
    n = k.shape[0]
    slots, ids = torch.arange(n * BS), torch.arange(n)
    cold = create_layer_kv(cold_codec, n, BS, H, D, dtype, layer_idx=layer_idx)
    cold.write(slots, k.flatten(0, 1), v.flatten(0, 1))
    cold_k, cold_v = cold.gather(ids)
    hot = create_layer_kv(hot_codec, n, BS, H, D, dtype, layer_idx=layer_idx)
    hot.write(slots, cold_k.flatten(0, 1), cold_v.flatten(0, 1))
    return hot.gather(ids)


def cold_bytes_per_block(codec: str, dtype: torch.dtype, num_layers: int = NUM_LAYERS) -> int:
    return sum(
        create_layer_kv(codec, 1, BS, H, D, dtype, layer_idx=i).bytes_per_block() for i in range(num_layers)
    )


def demoted_area(
    codec: str = "turbo3", chunks_room: float = 4.0
) -> tuple[list[LayerKV], BlockPool, ColdArea]:
    """Hot bf16 layers with a pool, and a turbo3 area with room for `chunks_room` chunks."""
    layers = make_hot("auto", torch.bfloat16)
    max_bytes = int(chunks_room * CHUNK_BLOCKS * cold_bytes_per_block(codec, torch.bfloat16))
    return layers, hot_pool(layers), ColdArea(layers, codec, max_bytes)


def demote_new(area: ColdArea, layers: list[LayerKV], pool: BlockPool, name: bytes, num_blocks=CHUNK_BLOCKS):
    """Fill fresh hot blocks, demote them as chunk `name`, release them; returns demote's answer."""
    ids = pool.allocate(num_blocks)
    fill(layers, ids, seed=len(name))
    stored = area.demote(name, ids, meta=name.decode())
    pool.release(ids)
    area.check_integrity()
    return stored


@pytest.mark.parametrize(
    "hot_codec,dtype,cold_codec",
    [
        ("auto", torch.float32, "turbo3"),
        ("auto", torch.bfloat16, "turbo3"),
        ("int8", torch.bfloat16, "turbo3"),
        ("auto", torch.bfloat16, "turbo4"),
    ],
    ids=["fp32-turbo3", "bf16-turbo3", "int8kivi-turbo3", "bf16-turbo4"],
)
def test_promoted_chunk_is_bitwise_the_reference(hot_codec, dtype, cold_codec):
    layers = make_hot(hot_codec, dtype)
    pool = hot_pool(layers)
    pool.allocate(3)  # the chunk does not start at block 0
    ids = pool.allocate(CHUNK_BLOCKS)
    fill(layers, ids, seed=1)
    original = [gather(layer, ids) for layer in layers]
    area = ColdArea(layers, cold_codec, max_bytes=1 << 30)
    assert area.demote(b"chunk", ids, meta={"tokens": 128})
    pool.release(ids)
    fill(layers, ids, seed=2)  # the freed blocks are reused for other work
    new_ids = pool.allocate(CHUNK_BLOCKS)
    assert new_ids != ids
    assert area.promote(b"chunk", new_ids) == {"tokens": 128}
    assert b"chunk" not in area and len(area) == 0
    area.check_integrity()
    for idx, layer in enumerate(layers):
        want = reference(cold_codec, hot_codec, dtype, idx, *original[idx])
        got = gather(layer, new_ids)
        for what, x, y, orig in zip("KV", got, want, original[idx], strict=True):
            assert torch.equal(bits(x), bits(y)), f"layer {idx}: promoted {what} differs from the reference"
            rel = (x.float() - orig.float()).norm() / orig.float().norm()
            assert rel < 0.25, f"layer {idx}: {what} relative error {rel:.3f} after the cold round trip"


def test_turbo3_tokens_per_byte_ratio_against_bf16():
    layers = make_hot("auto", torch.bfloat16)
    area = ColdArea(layers, "turbo3", max_bytes=1 << 30)
    stats = area.stats()
    hot_bpb = sum(layer.bytes_per_block() for layer in layers)
    cold_bpb = cold_bytes_per_block("turbo3", torch.bfloat16)
    print(f"turbo3 vs bf16 tokens per byte: {stats.tokens_per_byte_ratio:.3f}x")
    assert stats.tokens_per_byte_ratio == hot_bpb / cold_bpb
    assert stats.hot_bytes_per_token == hot_bpb / BS and stats.cold_bytes_per_token == cold_bpb / BS
    assert stats.tokens_per_byte_ratio > 4


def test_demotion_frees_hot_blocks_and_takes_cold_bytes():
    layers, pool, area = demoted_area()
    ids = pool.allocate(CHUNK_BLOCKS)
    fill(layers, ids, seed=3)
    free_before = pool.num_free_blocks
    assert area.demote(b"a", ids, meta=None)
    assert pool.num_free_blocks == free_before, "demote touched the hot pool"
    pool.release(ids)
    pool.check_integrity()
    assert pool.num_free_blocks == free_before + CHUNK_BLOCKS
    stats = area.stats()
    assert stats.used_bytes == CHUNK_BLOCKS * cold_bytes_per_block("turbo3", torch.bfloat16)
    assert stats.num_free_blocks == stats.num_blocks - CHUNK_BLOCKS
    assert (stats.num_chunks, stats.demotions) == (1, 1)
    area.check_integrity()


def test_lru_eviction_when_full():
    layers, pool, area = demoted_area(chunks_room=2.5)  # 2 chunks fit, not 3
    assert demote_new(area, layers, pool, b"a") and demote_new(area, layers, pool, b"b")
    assert area.meta(b"a") == "a"  # a lookup: now b is the least recently used
    assert demote_new(area, layers, pool, b"c")
    assert b"b" not in area and b"a" in area and b"c" in area
    assert area.stats().evictions == 1
    with pytest.raises(KeyError):
        area.promote(b"b", pool.allocate(CHUNK_BLOCKS))
    area.check_integrity()


def test_eviction_drops_as_many_chunks_as_needed():
    layers, pool, area = demoted_area(chunks_room=2)
    for name in (b"a", b"b", b"c", b"d"):
        assert demote_new(area, layers, pool, name, num_blocks=CHUNK_BLOCKS // 2)
    assert area.stats().num_free_blocks == 0
    assert demote_new(area, layers, pool, b"big", num_blocks=CHUNK_BLOCKS)
    assert [name in area for name in (b"a", b"b", b"c", b"d", b"big")] == [False, False, True, True, True]
    assert area.stats().evictions == 2


def test_chunk_larger_than_the_area_is_refused_and_evicts_nothing():
    layers, pool, area = demoted_area(chunks_room=1.5)
    assert demote_new(area, layers, pool, b"a")
    assert not demote_new(area, layers, pool, b"huge", num_blocks=2 * CHUNK_BLOCKS)
    assert b"a" in area and b"huge" not in area
    stats = area.stats()
    assert (stats.rejected_too_large, stats.evictions, stats.demotions) == (1, 0, 1)


def test_budget_below_one_block_is_a_config_error():
    layers = make_hot("auto", torch.bfloat16)
    one_block = cold_bytes_per_block("turbo3", torch.bfloat16)
    with pytest.raises(ConfigError, match=f"at least {one_block} bytes"):
        ColdArea(layers, "turbo3", max_bytes=one_block - 1)
    assert ColdArea(layers, "turbo3", max_bytes=one_block).num_blocks == 1


def test_budget_is_not_allocated_up_front():
    """A terabyte budget costs nothing until chunks are demoted (a preallocated pool would not fit)."""
    layers = make_hot("auto", torch.bfloat16)
    area = ColdArea(layers, "turbo3", max_bytes=1 << 40)
    assert area.num_blocks > 1 << 20 and area.stats().used_bytes == 0
    assert area.demote(b"a", [0, 1], meta=None)
    assert area.stats().used_bytes == 2 * cold_bytes_per_block("turbo3", torch.bfloat16)


def test_demote_of_a_held_chunk_changes_nothing():
    layers, pool, area = demoted_area()
    assert demote_new(area, layers, pool, b"a")
    before = area.stats()
    assert area.demote(b"a", [5, 6], meta="other")
    assert area.stats() == before and area.meta(b"a") == "a"
    area.check_integrity()


def test_discard():
    layers, pool, area = demoted_area()
    assert demote_new(area, layers, pool, b"a") and demote_new(area, layers, pool, b"b")
    assert area.discard(b"a") and not area.discard(b"a")
    assert b"a" not in area and len(area) == 1
    stats = area.stats()
    assert stats.used_bytes == CHUNK_BLOCKS * cold_bytes_per_block("turbo3", torch.bfloat16)
    assert stats.discards == 1
    area.check_integrity()


def test_promote_into_the_wrong_number_of_blocks_is_refused():
    layers, pool, area = demoted_area()
    assert demote_new(area, layers, pool, b"a")
    with pytest.raises(AssertionError, match="8-block chunk into 7 blocks"):
        area.promote(b"a", pool.allocate(CHUNK_BLOCKS - 1))


def test_integrity_check_catches_bad_accounting():
    layers, pool, area = demoted_area()
    assert demote_new(area, layers, pool, b"a")
    area.used_blocks += 1
    with pytest.raises(AssertionError, match="blocks held"):
        area.check_integrity()


def test_demote_and_promote_time_at_smollm2_shape():
    """Printed, not asserted: the engine thread's cost per 128-token chunk (30 layers, 3 kv heads,
    head_dim 64, bf16 hot, turbo3 cold)."""
    layers = make_hot("auto", torch.bfloat16, num_layers=30, h=3)
    pool = hot_pool(layers)
    area = ColdArea(layers, "turbo3", max_bytes=1 << 30)
    demote_s, promote_s = [], []
    for i in range(6):
        ids = pool.allocate(CHUNK_BLOCKS)
        fill(layers, ids, seed=i)
        start = time.perf_counter()
        area.demote(b"%d" % i, ids, meta=None)
        demote_s.append(time.perf_counter() - start)
        pool.release(ids)
        ids = pool.allocate(CHUNK_BLOCKS)
        start = time.perf_counter()
        area.promote(b"%d" % i, ids)
        promote_s.append(time.perf_counter() - start)
        pool.release(ids)
    demote_ms, promote_ms = (sorted(t)[len(t) // 2] * 1e3 for t in (demote_s, promote_s))
    print(
        f"128-token chunk, 30 layers x 3 kv heads x 64, bf16 -> turbo3, CPU with "
        f"{torch.get_num_threads()} thread(s): demote {demote_ms:.1f} ms, promote {promote_ms:.1f} ms (median of 6)"
    )
