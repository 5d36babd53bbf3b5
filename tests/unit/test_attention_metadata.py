"""AttentionMetadata.build makes the whole batch's tables and slots in a few tensor ops: it must equal
the per-sequence reference (slot_mapping of each sequence's blocks and positions) for every mix of
decode rows, prefill slices, rows at chosen positions and ragged block tables."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention.base import SMALL_BATCH_ROWS, AttentionMetadata, SeqRows
from kvserve.kvcache.block_pool import slot_mapping

BLOCK = 16


def _random_rows(rng: random.Random, n: int) -> list[SeqRows]:
    rows = []
    for _ in range(n):
        seq_len = rng.randint(1, 200)
        blocks = rng.sample(range(1000), -(-seq_len // BLOCK) + rng.randint(0, 2))  # some spare blocks
        kind = rng.choice(["decode", "prefill", "chosen"])
        if kind == "decode":
            positions = torch.tensor([seq_len - 1])
        elif kind == "prefill":
            q = rng.randint(1, seq_len)
            positions = torch.arange(seq_len - q, seq_len)
        else:
            positions = torch.tensor(sorted(rng.sample(range(seq_len), rng.randint(1, min(seq_len, 9)))))
        rows.append(SeqRows(blocks, positions, seq_len))
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_build_equals_the_per_sequence_reference(seed: int) -> None:
    rng = random.Random(seed)
    rows = _random_rows(rng, [1, 2, 7, 64][seed % 4])  # small batches map slots in Python, large in tensors
    meta = AttentionMetadata.build(rows, BLOCK, "cpu", explicit_positions=True)
    want_slots = torch.cat([slot_mapping(torch.tensor(r.block_ids), r.positions, BLOCK) for r in rows])
    assert torch.equal(meta.slot_mapping, want_slots)
    assert meta.query_lens_list == [len(r.positions) for r in rows]
    assert meta.seq_lens.tolist() == [r.seq_len for r in rows]
    assert meta.query_start_loc.tolist()[1:] == list(torch.cumsum(torch.tensor(meta.query_lens_list), 0))
    for i, r in enumerate(rows):
        assert meta.block_tables[i, : len(r.block_ids)].tolist() == r.block_ids
        assert not meta.block_tables[i, len(r.block_ids) :].any()  # padded with 0
    assert meta.query_positions is not None and torch.equal(
        meta.query_positions, torch.cat([r.positions for r in rows])
    )
    assert torch.equal(
        AttentionMetadata.build(rows, BLOCK, "cpu", write=False).slot_mapping,
        torch.full((len(want_slots),), -1),
    )


def test_all_decode_rows_and_an_empty_batch() -> None:
    rows = [SeqRows([5, 9], torch.tensor([20]), 21), SeqRows([3], torch.tensor([0]), 1)]
    meta = AttentionMetadata.build(rows, BLOCK, "cpu")
    assert meta.slot_mapping.tolist() == [9 * BLOCK + 4, 3 * BLOCK]
    assert meta.is_pure_decode and meta.query_positions is None
    empty = AttentionMetadata.build([], BLOCK, "cpu")
    assert empty.num_seqs == 0 and empty.slot_mapping.numel() == 0 and empty.block_tables.shape == (0, 0)


@pytest.mark.parametrize("extra_rows", [0, SMALL_BATCH_ROWS])  # the Python ints' path and the tensors'
def test_a_position_past_its_blocks_raises_not_reads_the_padding(extra_rows: int) -> None:
    rows = [SeqRows([1, 2, 3], torch.tensor([40]), 41), SeqRows([4], torch.arange(16 - extra_rows, 17), 17)]
    with pytest.raises(IndexError):
        AttentionMetadata.build(rows, BLOCK, "cpu")


@pytest.mark.parametrize("n", [1, 5, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 130])
def test_decode_equals_build_for_one_row_per_sequence(n: int) -> None:
    """AttentionMetadata.decode (a plain decode step's lists) makes build's tensors, both slot paths."""
    rng = random.Random(n)
    tables, positions = [], []
    for _ in range(n):
        seq_len = rng.randint(1, 200)
        tables.append(rng.sample(range(1000), -(-seq_len // BLOCK) + rng.randint(0, 2)))
        positions.append(seq_len - 1)
    got = AttentionMetadata.decode(tables, positions, BLOCK, "cpu")
    want = AttentionMetadata.build(
        [SeqRows(t, torch.tensor([p]), p + 1) for t, p in zip(tables, positions, strict=True)], BLOCK, "cpu"
    )
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.query_lens_list == want.query_lens_list and got.seq_lens_list == want.seq_lens_list
    assert got.query_positions is None and want.query_positions is None
    with pytest.raises(IndexError):
        AttentionMetadata.decode([[1]], [BLOCK], BLOCK, "cpu")  # past its one block
