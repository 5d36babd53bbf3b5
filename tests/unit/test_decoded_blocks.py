"""Kept decoded blocks (QuantizedLayerKV.decoded_view) against decoding every block every step.

Two pools take the same random writes, seals, copies, frees and imports; after each, attention's
dense input from the pool that keeps decoded blocks equals, bitwise and entry by entry of the block
table, the one decoded fresh from the pool that keeps none."""

import random

import pytest
import torch

from kvserve.attention.base import dense_copy
from kvserve.kvcache.quantized_storage import QuantizedLayerKV

BS, H, D, NUM_BLOCKS = 16, 2, 64, 24
BLOCK_BYTES_BF16 = 2 * BS * H * D * 2  # K and V of one block in bfloat16


def pools(codec: str, dtype: torch.dtype, kept_blocks: int) -> tuple[QuantizedLayerKV, QuantizedLayerKV]:
    size = torch.tensor([], dtype=dtype).element_size()
    kept = QuantizedLayerKV(
        codec, NUM_BLOCKS, BS, H, D, dtype, decoded_bytes=kept_blocks * 2 * BS * H * D * size
    )
    fresh = QuantizedLayerKV(codec, NUM_BLOCKS, BS, H, D, dtype)
    assert kept.decoded is not None and fresh.decoded is None
    return kept, fresh


def assert_same_input(kept: QuantizedLayerKV, fresh: QuantizedLayerKV, tables: torch.Tensor, dtype) -> None:
    k1, v1, t1 = dense_copy(kept, tables, dtype)
    k2, v2, t2 = dense_copy(fresh, tables, dtype)
    assert k1.dtype == k2.dtype == dtype
    assert torch.equal(k1[t1.long()], k2[t2.long()])
    assert torch.equal(v1[t1.long()], v2[t2.long()])


@pytest.mark.parametrize(
    "codec", ["int4dq", "kint3-vturbo3", "kint3dq-vturbo2", "turbo3", "nvfp4", "mxfp4", "int2"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_blocks_equal_fresh_decode_through_every_write(codec, dtype):
    rng = random.Random(f"{codec}{dtype}")
    torch.manual_seed(0)
    kept, fresh = pools(codec, dtype, kept_blocks=10)  # fewer than the pool: rows are reused
    both = (kept, fresh)
    for _ in range(60):
        op = rng.choice(["tokens", "tokens", "tokens", "block", "seal", "copy", "free", "import", "hold"])
        if op == "tokens":  # a few rows of one block (decode steps, chunked prefill, repairs)
            block, start = rng.randrange(NUM_BLOCKS), rng.randrange(BS)
            n = rng.randint(1, BS - start)
            slots = torch.arange(block * BS + start, block * BS + start + n)
            k, v = torch.randn(n, H, D, dtype=dtype), torch.randn(n, H, D, dtype=dtype)
            k[:, 0, 3] += 8  # a K channel offset, as real K has
            for kv in both:
                kv.write(slots, k, v)
        elif op == "block":
            block = rng.randrange(NUM_BLOCKS)
            k, v = torch.randn(BS, H, D, dtype=dtype), torch.randn(BS, H, D, dtype=dtype)
            for kv in both:
                kv.write(torch.arange(block * BS, (block + 1) * BS), k, v)
        elif op == "seal":
            ids = rng.sample(range(NUM_BLOCKS), 3)
            for kv in both:
                kv.seal(ids)
        elif op == "copy":
            src, dst = rng.sample(range(NUM_BLOCKS), 2)
            for kv in both:
                kv.copy_blocks(torch.tensor([src]), torch.tensor([dst]))
        elif op == "free":
            block = rng.randrange(NUM_BLOCKS)
            for kv in both:
                kv.on_block_freed(block)
        elif op == "import":
            closed = sorted(b for b in fresh.closed if b not in fresh.open_k) if not fresh.per_token else []
            src = closed[:1] if closed else ([rng.randrange(NUM_BLOCKS)] if fresh.per_token else [])
            if src:
                dst = rng.randrange(NUM_BLOCKS)
                fields = fresh.export_blocks(src)
                for kv in both:
                    kv.import_blocks([dst], fields)
        else:  # a content-reuse assembly: hold, rewrite rows of a block, release
            block = rng.randrange(NUM_BLOCKS)
            k, v = torch.randn(2, H, D, dtype=dtype), torch.randn(2, H, D, dtype=dtype)
            for kv in both:
                kv.hold_exact([block])
                kv.write(torch.tensor([block * BS + 3, block * BS + 4]), k, v)
                kv.release_exact([block])
        # a step's table: a few sequences' blocks, padded with repeats as the engine pads
        rows = [rng.sample(range(NUM_BLOCKS), rng.randint(1, 4)) for _ in range(rng.randint(1, 3))]
        width = max(map(len, rows))
        tables = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.int32)
        assert_same_input(kept, fresh, tables, dtype)
    assert kept.decoded.num_reused > 0 and kept.decoded.num_decoded > 0
    assert kept.decoded.capacity <= 10


def test_a_step_over_the_budget_decodes_afresh_and_keeps_nothing_new():
    kept, fresh = pools("int4dq", torch.bfloat16, kept_blocks=4)
    k, v = torch.randn(8 * BS, H, D).bfloat16(), torch.randn(8 * BS, H, D).bfloat16()
    for kv in (kept, fresh):
        kv.write(torch.arange(8 * BS), k, v)
    assert kept.decoded_view(torch.arange(8, dtype=torch.int32)[None], torch.bfloat16) is None
    assert_same_input(kept, fresh, torch.arange(8, dtype=torch.int32)[None], torch.bfloat16)
    assert kept.decoded.capacity == 0
    assert_same_input(kept, fresh, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.bfloat16)
    assert kept.decoded.capacity == 4 and kept.decoded.num_decoded == 4


def test_a_decode_step_decodes_only_the_block_it_wrote():
    kept, _ = pools("kint3-vturbo3", torch.bfloat16, kept_blocks=16)
    kv_rows = torch.randn(40, H, D).bfloat16()
    kept.write(torch.arange(40), kv_rows, kv_rows)  # blocks 0, 1 closed, block 2 open at 8 rows
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    kept.decoded_view(tables, torch.bfloat16)
    assert (kept.decoded.num_decoded, kept.decoded.num_reused) == (3, 0)
    kept.write(torch.tensor([40]), kv_rows[:1], kv_rows[:1])  # the next token
    kept.decoded_view(tables, torch.bfloat16)
    assert (kept.decoded.num_decoded, kept.decoded.num_reused) == (4, 2)
    assert kept.decoded_view(tables, torch.float32) is None  # kept in the compute dtype only
    assert kept.decoded_stats() == (kept.decoded.used_bytes(), 4, 2)
    assert kept.decoded.used_bytes() == 4 * BLOCK_BYTES_BF16  # grown to 4 rows, within the 16
