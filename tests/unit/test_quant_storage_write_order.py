"""Quantized storage: a block's content depends only on the final rows written to it.

Content reuse (reuse/repairer.py, reuse/repair.py) writes a sequence's blocks out of order: the moved rows of
every hit (anywhere in a block), then fresh rows (often at offset 0 of the same blocks), then repair
rows that rewrite some moved rows, possibly of a block that already filled and was encoded. The
blocks come straight from the free list, still holding a previous owner's codes. Every test here
compares that against the oracle: the same final rows written once, in position order, into a clean
pool of the same codec. The comparison is bitwise: each block is encoded from exactly the same
full-precision rows, so nothing less is achievable or accepted.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.kvcache.quantized_storage import QuantizedLayerKV
from kvserve.quant.registry import CODEC_NAMES, make_codec

BS, H, D = 16, 2, 64
NUM_BLOCKS = 8
BLOCKS = [5, 2, 6]  # the sequence's blocks, in position order
N = 40  # positions [0, 40): two full blocks and 8 rows of the third

# The blend-like write order. Position map (block = position // 16):
#   moved   [3, 32) and [33, 39): mid-block starts in blocks 0 and 2; block 1 fills from moved rows
#   fresh   [0, 3), 32, 39: offset-0 writes into blocks 0 and 2, which already hold moved rows
#   repair  [3, 8), [16, 19), [33, 35): moved rows recomputed; those of block 1 after it was encoded
MOVED = list(range(3, 32)) + list(range(33, 39))
FRESH = [0, 1, 2, 32, 39]
REPAIR = list(range(3, 8)) + list(range(16, 19)) + [33, 34]

# K per channel over the whole block (KIVI's K: int*, int*dq and the kint* pairs)
BLOCK_CODECS = [n for n in CODEC_NAMES if not make_codec(n, H, D).k.per_token]
PER_TOKEN_CODECS = [n for n in CODEC_NAMES if n not in BLOCK_CODECS]


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(N, H, D, generator=g), torch.randn(N, H, D, generator=g)
    k[:, :, 7] *= 20  # an outlier channel, as real K has
    return k, v


FINAL = _rows(1)  # the rows the sequence's blocks must end up holding
DECOY = _rows(2)  # what moved rows held before their repair overwrote them


def _slots(positions: list[int]) -> torch.Tensor:
    pos = torch.tensor(positions, dtype=torch.long)
    return torch.tensor(BLOCKS)[pos // BS] * BS + pos % BS


def _previous_owner(kv: QuantizedLayerKV) -> None:
    """Every block filled with other, larger content (one of ours left open), then freed."""
    g = torch.Generator().manual_seed(99)
    left_open = set(range(6 * BS + 11, 7 * BS))  # block 6 (our third block) keeps 5 slots open
    slots = torch.tensor([s for s in range(NUM_BLOCKS * BS) if s not in left_open])
    k, v = (
        30 * torch.randn(len(slots), H, D, generator=g) + 9,
        30 * torch.randn(len(slots), H, D, generator=g),
    )
    kv.write(slots, k, v)
    for block_id in range(NUM_BLOCKS):
        kv.on_block_freed(block_id)


def _write(kv: QuantizedLayerKV, positions: list[int], rows: tuple[torch.Tensor, torch.Tensor]) -> None:
    kv.write(_slots(positions), rows[0][positions], rows[1][positions])


def _blend_order(kv: QuantizedLayerKV, repair: bool) -> None:
    """Moved rows (decoys where a repair follows), then fresh and repaired rows in one write."""
    repaired = set(REPAIR) if repair else set()
    moved_k, moved_v = FINAL[0].clone(), FINAL[1].clone()
    for p in repaired:
        moved_k[p], moved_v[p] = DECOY[0][p], DECOY[1][p]
    _write(kv, MOVED, (moved_k, moved_v))
    _write(kv, sorted(FRESH + sorted(repaired)), FINAL)


def _oracle(name: str) -> QuantizedLayerKV:
    kv = QuantizedLayerKV(name, NUM_BLOCKS, BS, H, D, torch.float32)
    _write(kv, list(range(N)), FINAL)
    return kv


def _assert_same(got: QuantizedLayerKV, want: QuantizedLayerKV) -> None:
    block_ids = torch.tensor(BLOCKS)
    (k_got, v_got), (k_want, v_want) = got.gather(block_ids), want.gather(block_ids)
    flat = (-1, H, D)
    for what, a, b in (("K", k_got, k_want), ("V", v_got, v_want)):
        a, b = a.reshape(flat)[:N], b.reshape(flat)[:N]  # rows past N were never written
        bad = (a != b).any(dim=(1, 2)).nonzero().squeeze(1).tolist()
        assert not bad, f"{what} differs from the in-order oracle at positions {bad}"
    # what kernels read in place: the same blocks open (K in the shadow), the others read as codes
    open_got = (got.open_k.slot_of_block[block_ids] >= 0).tolist()
    assert open_got == (want.open_k.slot_of_block[block_ids] >= 0).tolist()
    assert got.shadow_bytes() == want.shadow_bytes()


@pytest.mark.parametrize("name", BLOCK_CODECS + PER_TOKEN_CODECS)
def test_moved_then_fresh_rows_into_a_reused_block_equal_in_order_writes(name):
    """Mid-block starts and offset-0 writes after moved rows, no rewrites: no hold needed."""
    kv = QuantizedLayerKV(name, NUM_BLOCKS, BS, H, D, torch.float32)
    _previous_owner(kv)
    _blend_order(kv, repair=False)
    _assert_same(kv, _oracle(name))


@pytest.mark.parametrize("name", BLOCK_CODECS + PER_TOKEN_CODECS)
def test_repair_of_encoded_rows_under_hold_equals_in_order_writes(name):
    kv = QuantizedLayerKV(name, NUM_BLOCKS, BS, H, D, torch.float32)
    _previous_owner(kv)
    kv.hold_exact(BLOCKS)
    _blend_order(kv, repair=True)
    kv.release_exact(BLOCKS)
    _assert_same(kv, _oracle(name))
    assert kv.shadow_bytes() == BS * H * D * 4 * (not kv.codec.k.per_token)  # only the open third block


@pytest.mark.parametrize("name", BLOCK_CODECS + ["fp8_e4m3", "turbo3"])
@pytest.mark.parametrize("seed", range(4))
def test_any_order_with_rewrites_under_hold_equals_in_order_writes(name, seed):
    """Random order, random run lengths, random rows first written with decoys and rewritten."""
    rng = random.Random(seed)
    kv = QuantizedLayerKV(name, NUM_BLOCKS, BS, H, D, torch.float32)
    _previous_owner(kv)
    kv.hold_exact(BLOCKS)
    writes = [(p, FINAL) for p in rng.sample(range(N), N)]
    for p in rng.sample(range(N), 12):  # a decoy anywhere before the position's final row
        writes.insert(rng.randint(0, writes.index((p, FINAL))), (p, DECOY))
    i = 0
    while i < len(writes):
        n = rng.randint(1, 9)
        batch = writes[i : i + n]
        if len({p for p, _ in batch}) == len(batch):  # one write never names a slot twice
            k = torch.stack([rows[0][p] for p, rows in batch])
            v = torch.stack([rows[1][p] for p, rows in batch])
            kv.write(_slots([p for p, _ in batch]), k, v)
            i += n
    kv.release_exact(BLOCKS)
    _assert_same(kv, _oracle(name))


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_held_block_keeps_filling_after_release_and_frees_clean(name):
    """The last, partial block stays open after the assembly; decode steps then fill it."""
    kv = QuantizedLayerKV(name, NUM_BLOCKS, BS, H, D, torch.float32)
    _previous_owner(kv)
    kv.hold_exact(BLOCKS)
    _blend_order(kv, repair=True)
    kv.release_exact(BLOCKS)
    more = torch.randn(2 * BS - N % BS, H, D)
    tail_slots = torch.tensor([BLOCKS[-1] * BS + o for o in range(N % BS, BS)])
    kv.write(tail_slots, more[: len(tail_slots)], more[: len(tail_slots)])
    want = _oracle(name)
    want.write(tail_slots, more[: len(tail_slots)], more[: len(tail_slots)])
    k_got, k_want = kv.gather(torch.tensor(BLOCKS))[0], want.gather(torch.tensor(BLOCKS))[0]
    assert torch.equal(k_got, k_want) and kv.shadow_bytes() == 0
    kv.hold_exact(BLOCKS)
    kv.write(_slots([20]), FINAL[0][[20]], FINAL[1][[20]])  # a held, encoded block rewritten...
    assert kv.shadow_bytes() > 0
    for block_id in BLOCKS:
        kv.on_block_freed(block_id)  # ...then freed: nothing of it is kept
    assert kv.shadow_bytes() == 0


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_seal_encodes_a_partly_written_block_from_its_written_rows(codec: str):
    """A sealed block equals the block encoded with its unwritten rows copied from its first written
    row (so they widen no channel range), and drops its full-precision shadow."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    torch.manual_seed(0)
    kv = create_layer_kv(codec, 4, 16, 2, 16, torch.float32, "cpu")
    rows = torch.randn(16, 2, 16) * 3
    written = list(range(3, 12))
    kv.write(torch.tensor([16 + i for i in written]), rows[written], rows[written])
    assert kv.shadow_bytes() > 0
    kv.seal([1])
    assert kv.shadow_bytes() == 0
    padded = rows.clone()
    padded[[i for i in range(16) if i not in written]] = rows[written[0]]
    oracle = create_layer_kv(codec, 4, 16, 2, 16, torch.float32, "cpu")
    oracle.write(torch.arange(16, 32), padded, padded)
    got, want = kv.gather(torch.tensor([1]))[0][0], oracle.gather(torch.tensor([1]))[0][0]
    assert torch.equal(got[written], want[written])
