"""A chunk's KV exported to bytes and imported into other blocks reads back bitwise, under every
storage (dense in fp32 / bf16, every codec of the registry, under fp32 and bf16 compute), and a
payload that does not fit its target is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.kvcache.chunk_payload import VERSION, ChunkPayloadError, _read_header, export_chunk, import_chunk
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.quantized_storage import create_layer_kv
from kvserve.quant.registry import CODEC_NAMES

BS, H, D, NUM_BLOCKS, NUM_LAYERS = 8, 2, 32, 12, 3
SRC_FULL, SRC_SEALED = [2, 5, 7], 3  # three complete blocks, then a tail's block of 3 rows, sealed
DST = [0, 11, 4, 9]
STORAGES = [(codec, dtype) for dtype in (torch.float32, torch.bfloat16) for codec in ("auto", *CODEC_NAMES)]
STORAGE_IDS = [f"{codec}-{str(dtype).removeprefix('torch.')}" for codec, dtype in STORAGES]


def make_layers(codec: str, dtype: torch.dtype, num_layers: int = NUM_LAYERS, **shape) -> list[LayerKV]:
    dims = {"num_blocks": NUM_BLOCKS, "block_size": BS, "num_kv_heads": H, "head_dim": D, **shape}
    return [create_layer_kv(codec, compute_dtype=dtype, layer_idx=i, **dims) for i in range(num_layers)]


def fill(layers: list[LayerKV], seed: int) -> None:
    """Random K/V into SRC_FULL (rows in a random order, so a block codec's K passes through its
    open shadow) and 3 rows of SRC_SEALED, then sealed like a cached tail."""
    gen = torch.Generator().manual_seed(seed)
    for layer in layers:
        bs, shape = layer.block_size, (layer.num_kv_heads, layer.head_dim)
        full = torch.tensor(SRC_FULL).repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(SRC_FULL))
        slots = torch.cat([full[torch.randperm(len(full), generator=gen)], SRC_SEALED * bs + torch.arange(3)])
        k = torch.randn(len(slots), *shape, generator=gen) * 3
        v = torch.randn(len(slots), *shape, generator=gen)
        for part in slots.split(5):  # several writes, like prefill slices
            rows = torch.isin(slots, part)
            layer.write(part, k[rows], v[rows])
        layer.seal([SRC_SEALED])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: equal bits, not equal values (-0.0 != 0.0, NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_kv(src: list[LayerKV], src_ids: list[int], dst: list[LayerKV], dst_ids: list[int]) -> None:
    for idx, (a, b) in enumerate(zip(src, dst, strict=True)):
        for what, x, y in zip(
            ("K", "V"), a.gather(torch.tensor(src_ids)), b.gather(torch.tensor(dst_ids)), strict=True
        ):
            assert torch.equal(bits(x), bits(y)), f"layer {idx}: gathered {what} differs"
        slots_a = (torch.tensor(src_ids)[:, None] * BS + torch.arange(BS)).flatten()
        slots_b = (torch.tensor(dst_ids)[:, None] * BS + torch.arange(BS)).flatten()
        for what, x, y in zip(("K", "V"), a.read_slots(slots_a), b.read_slots(slots_b), strict=True):
            assert torch.equal(bits(x), bits(y)), f"layer {idx}: read_slots {what} differs"


@pytest.mark.parametrize(("codec", "dtype"), STORAGES, ids=STORAGE_IDS)
def test_roundtrip_is_bitwise_into_other_blocks(codec, dtype):
    src_ids = [*SRC_FULL, SRC_SEALED]
    layers = make_layers(codec, dtype)
    fill(layers, seed=1)
    payload = export_chunk(layers, src_ids)

    # the same layers, other blocks; one of them left open with rows of another sequence: the import
    # must replace it whole (a block codec's shadow of it dropped)
    for layer in layers:
        layer.write(torch.tensor([DST[1] * BS]), torch.full((1, H, D), 7.0), torch.full((1, H, D), 7.0))
    import_chunk(layers, DST, payload)
    assert_same_kv(layers, src_ids, layers, DST)
    assert export_chunk(layers, DST) == payload  # stored bytes equal, and the blocks export again

    fresh = make_layers(codec, dtype)  # a new process's pool
    import_chunk(fresh, DST[::-1], payload)
    assert_same_kv(layers, src_ids, fresh, DST[::-1])


@pytest.mark.parametrize(("codec", "dtype"), STORAGES, ids=STORAGE_IDS)
def test_payload_is_the_stored_bytes_plus_a_small_header(codec, dtype):
    layers = make_layers(codec, dtype)
    fill(layers, seed=2)
    payload = export_chunk(layers, SRC_FULL)
    _, body_offset = _read_header(payload)
    stored = sum(layer.bytes_per_block() for layer in layers) * len(SRC_FULL)
    assert len(payload) - body_offset == stored
    assert body_offset < 400, f"header of {body_offset} bytes"
    assert body_offset % 16 == 0  # the body is aligned (the header is padded): fields import without a copy
    # the header describes a format once, however many layers share it: 2 bytes (",0") per more
    # layer, up to the padding
    deep = make_layers(codec, dtype, num_layers=30)
    fill(deep, seed=2)
    _, deep_body_offset = _read_header(export_chunk(deep, SRC_FULL))
    assert abs(deep_body_offset - body_offset - 2 * (30 - NUM_LAYERS)) < 16


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (dict(codec="int8"), "layer 0: payload stores"),  # another codec
        (dict(codec="auto", dtype=torch.bfloat16), "layer 0: payload stores"),  # dense, another dtype
        (dict(num_kv_heads=4), "layer 0: payload stores"),
        (dict(block_size=16), "layer 0: payload stores"),
        (dict(num_layers=NUM_LAYERS + 1), "layers, target model has"),
    ],
    ids=["codec", "dense-dtype", "heads", "block-size", "layers"],
)
@pytest.mark.parametrize("source", ["int4", "auto"])
def test_mismatched_target_is_refused_untouched(source, target, message):
    src = make_layers(source, torch.float32)
    fill(src, seed=3)
    payload = export_chunk(src, SRC_FULL)
    target = dict(target)  # the parameter is shared between sources
    codec, dtype = target.pop("codec", source), target.pop("dtype", torch.float32)
    assert (codec, dtype, target) != (source, torch.float32, {}), "the case mismatches nothing"
    dst = make_layers(codec, dtype, **target)
    fill(dst, seed=13)  # blocks of its own, which a refused import must leave as they were
    before = export_chunk(dst, SRC_FULL)
    with pytest.raises(ChunkPayloadError, match=message):
        import_chunk(dst, SRC_FULL, payload)
    assert export_chunk(dst, SRC_FULL) == before


def test_wrong_block_count_is_refused():
    layers = make_layers("turbo3", torch.float32)
    fill(layers, seed=4)
    payload = export_chunk(layers, SRC_FULL)
    with pytest.raises(ChunkPayloadError, match="holds 3 blocks, target has 2"):
        import_chunk(layers, [0, 1], payload)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p[:-1],  # one byte short
        lambda p: p[: len(p) // 2],  # cut inside the body
        lambda p: p[:20],  # cut inside the header
        lambda p: p[:5],  # cut inside the prelude
        lambda p: b"",
        lambda p: p + b"\0",  # padded
        lambda p: b"XXXX" + p[4:],  # not a payload
        lambda p: p[:4] + (VERSION + 1).to_bytes(2, "little") + p[6:],  # a future format version
        lambda p: p[:10] + b"{" * 8 + p[18:],  # a corrupt header
    ],
    ids=["short-1", "half", "in-header", "in-prelude", "empty", "padded", "magic", "version", "header-json"],
)
def test_damaged_payload_is_refused(damage):
    layers = make_layers("int4", torch.float32)
    fill(layers, seed=5)
    payload = export_chunk(layers, SRC_FULL)
    with pytest.raises(ChunkPayloadError):
        import_chunk(layers, [0, 1, 4], damage(payload))


def test_open_block_does_not_export():
    layers = make_layers("int4", torch.float32, num_layers=1)
    layers[0].write(torch.arange(3) + BS, torch.randn(3, H, D), torch.randn(3, H, D))  # block 1, open
    with pytest.raises(AssertionError, match="open blocks"):
        export_chunk(layers, [1])


@pytest.mark.parametrize("codec", ["auto", "int4", "turbo3"])
def test_engine_chunks_roundtrip(codec):
    """The blocks of every chunk an engine registered (whole chunks and a warmed text's sealed tail)
    export, import into free pool blocks, and gather bitwise the same."""
    llm = LLM(
        "tiny-random-llama", kv_cache_dtype=codec, chunk_size=32, block_size=16, max_cache_bytes=5_000_000
    )
    llm.warm("The quick brown fox jumps over the lazy dog. " * 8)
    engine = llm.engine
    chunks = engine.store.chunks()
    assert len(chunks) >= 3 and any(c.num_tokens < 32 for c in chunks), [c.num_tokens for c in chunks]
    for chunk in chunks:
        payload = export_chunk(engine.layers, chunk.block_ids)
        free = engine.pool.allocate(len(chunk.block_ids))
        import_chunk(engine.layers, free, payload)
        for idx, layer in enumerate(engine.layers):
            got, want = layer.gather(torch.tensor(free)), layer.gather(torch.tensor(chunk.block_ids))
            for what, g, w in zip(("K", "V"), got, want, strict=True):
                assert torch.equal(bits(g), bits(w)), f"chunk depth {chunk.depth} layer {idx}: {what} differs"
        engine.pool.release(free)
    engine.pool.check_integrity()
    engine.store.check_integrity()
