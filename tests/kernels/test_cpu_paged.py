"""cpu_paged against the reference backend (fp32, bf16), on every block-table layout."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import cpu_paged
from kvserve.attention.cpu_paged import CpuPagedBackend, Segment, block_runs, plan_segments
from kvserve.attention.reference import ReferenceBackend
from kvserve.kernels.paged_batch import make_batch

SHAPES = {
    "prefill": [(37, 37), (64, 64)],
    "chunked_prefill": [(20, 100), (5, 300)],
    "decode": [(1, 1), (1, 77), (1, 300)],
    "mixed": [(1, 50), (33, 33), (12, 140), (1, 9)],
}


def _check(lens, h, h_kv, d, bs, dtype, layout, atol):
    query, kv, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout)
    scale = d**-0.5
    ref = ReferenceBackend().forward(query, kv, meta, scale)
    out = CpuPagedBackend().forward(query, kv, meta, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("layout", ["contiguous", "shuffled", "mixed"])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (8, 1)])
def test_parity_fp32(kind, layout, h, h_kv):
    _check(SHAPES[kind], h, h_kv, 64, 16, torch.float32, layout, atol=1e-5)


@pytest.mark.parametrize("d,bs", [(128, 32), (64, 32), (128, 16)])
def test_parity_head_dim_block_size(d, bs):
    _check(SHAPES["mixed"] + SHAPES["chunked_prefill"], 6, 2, d, bs, torch.float32, "mixed", atol=1e-5)


def test_parity_bf16():
    _check(SHAPES["mixed"], 6, 2, 64, 16, torch.bfloat16, "mixed", atol=2e-2)


def test_small_gather_groups(monkeypatch):
    """Many gathered segments per sequence, each merged through its log-sum-exp."""
    monkeypatch.setattr(cpu_paged, "GATHER_BYTES", 2 * 16 * 2 * 64 * 4)  # two blocks
    _check([(1, 300), (40, 300), (70, 70)], 6, 2, 64, 16, torch.float32, "shuffled", atol=1e-5)


def test_block_runs():
    assert block_runs(torch.tensor([], dtype=torch.int64)) == []
    assert block_runs(torch.tensor([5])) == [(0, 1)]
    assert block_runs(torch.tensor([3, 4, 5, 9, 1, 2])) == [(0, 3), (3, 1), (4, 2)]


def test_plan_segments_views_and_gathers(monkeypatch):
    monkeypatch.setattr(cpu_paged, "MIN_VIEW_BLOCKS", 3)
    ids = torch.tensor([7, 8, 9, 10, 2, 5, 6, 30, 31, 32])
    segs = plan_segments(ids, seq_len=150, block_size=16, gather_blocks=2, can_view=True)
    assert segs == [
        Segment(0, 4, 0, 64, True),
        Segment(4, 2, 64, 96, False),
        Segment(6, 1, 96, 112, False),
        Segment(7, 3, 112, 150, True),
    ]
    gathered = plan_segments(ids, seq_len=150, block_size=16, gather_blocks=4, can_view=False)
    assert [(s.first_block, s.num_blocks, s.is_view) for s in gathered] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, False),
    ]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_quantized_pool_matches_reference(codec):
    """Non-dense pools go through LayerKV.gather; the reference reads the same dequantized values."""
    quant_storage = pytest.importorskip("kvserve.quant.storage")
    lens = [(1, 70), (9, 40), (1, 5)]
    query, dense, meta = make_batch(lens, 6, 2, 64, 16, torch.float32, "shuffled")
    kv = quant_storage.create_layer_kv(codec, dense.num_blocks, 16, 2, 64, torch.float32)
    slots = torch.arange(dense.num_blocks * 16)
    kv.write(slots, dense.k_cache.view(-1, 2, 64), dense.v_cache.view(-1, 2, 64))
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = CpuPagedBackend().forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
