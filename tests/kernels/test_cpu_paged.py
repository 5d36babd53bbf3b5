"""cpu_paged against the reference backend (fp32, bf16), on every block-table layout, with the C++
extension (every row) and without it (the torch-ops path). Batch invariance: test_cpu_invariance.py."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import cpu_paged
from kvserve.attention.cpu_paged import CpuPagedBackend, KVSpan, block_runs, plan_spans
from kvserve.attention.reference import ReferenceBackend
from kvserve.attention.testing import make_batch, quantized_copy
from kvserve.kernels import cpu_ext

SHAPES = {
    "prefill": [(37, 37), (64, 64)],
    "chunked_prefill": [(20, 100), (5, 300)],
    "decode": [(1, 1), (1, 77), (1, 300)],
    "mixed": [(1, 50), (33, 33), (12, 140), (1, 9)],
}


def _check(lens, h, h_kv, d, bs, dtype, layout, atol, use_extension=True):
    query, kv, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout)
    scale = d**-0.5
    ref = ReferenceBackend().forward(query, kv, meta, scale)
    out = CpuPagedBackend(use_extension).forward(query, kv, meta, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("layout", ["contiguous", "shuffled", "mixed"])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "torch"])
def test_parity_fp32(kind, layout, h, h_kv, use_extension):
    _check(SHAPES[kind], h, h_kv, 64, 16, torch.float32, layout, atol=1e-5, use_extension=use_extension)


@pytest.mark.parametrize("d,bs", [(128, 32), (64, 32), (128, 16)])
def test_parity_head_dim_block_size(d, bs):
    _check(SHAPES["mixed"] + SHAPES["chunked_prefill"], 6, 2, d, bs, torch.float32, "mixed", atol=1e-5)


def test_parity_bf16():
    _check(SHAPES["mixed"], 6, 2, 64, 16, torch.bfloat16, "mixed", atol=2e-2)


def test_small_gather_groups(monkeypatch):
    """Torch-ops path: many gathered spans per sequence, each merged through its log-sum-exp."""
    monkeypatch.setattr(cpu_paged, "GATHER_BYTES", 2 * 16 * 2 * 64 * 4)  # two blocks
    lens = [(1, 300), (40, 300), (70, 70)]
    _check(lens, 6, 2, 64, 16, torch.float32, "shuffled", atol=1e-5, use_extension=False)


def test_block_runs():
    assert block_runs(torch.tensor([], dtype=torch.int64)) == []
    assert block_runs(torch.tensor([5])) == [(0, 1)]
    assert block_runs(torch.tensor([3, 4, 5, 9, 1, 2])) == [(0, 3), (3, 1), (4, 2)]


def test_plan_spans_views_and_gathers(monkeypatch):
    monkeypatch.setattr(cpu_paged, "MIN_VIEW_BLOCKS", 3)
    ids = torch.tensor([7, 8, 9, 10, 2, 5, 6, 30, 31, 32])
    spans = plan_spans(ids, seq_len=150, block_size=16, gather_blocks=2, can_view=True)
    assert spans == [
        KVSpan(0, 4, 0, 64, True),
        KVSpan(4, 2, 64, 96, False),
        KVSpan(6, 1, 96, 112, False),
        KVSpan(7, 3, 112, 150, True),
    ]
    gathered = plan_spans(ids, seq_len=150, block_size=16, gather_blocks=4, can_view=False)
    assert [(s.first_block, s.num_blocks, s.is_view) for s in gathered] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, False),
    ]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "int4", "turbo4", "mxfp4"])
@pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "torch"])
def test_quantized_pool_matches_reference(codec, use_extension):
    """Quantized pools: read in place (ext: int8, fp8), through a dense copy (ext: int4, turbo4,
    mxfp4) or LayerKV.gather (torch); the reference reads the same dequantized values."""
    quant_storage = pytest.importorskip("kvserve.kvcache.quantized_storage")
    lens = [(1, 70), (9, 40), (1, 5)]
    query, dense, meta = make_batch(lens, 6, 2, 64, 16, torch.float32, "shuffled")
    kv = quant_storage.create_layer_kv(codec, dense.num_blocks, 16, 2, 64, torch.float32)
    slots = torch.arange(dense.num_blocks * 16)
    kv.write(slots, dense.k_cache.view(-1, 2, 64), dense.v_cache.view(-1, 2, 64))
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = CpuPagedBackend(use_extension).forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_backend_uses_the_extension(ext):
    assert CpuPagedBackend().ext is ext
    assert CpuPagedBackend(use_extension=False).ext is None


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "bf16", "fp16"])
@pytest.mark.parametrize("h,h_kv,d,bs", [(4, 4, 64, 16), (6, 2, 128, 32), (8, 1, 64, 32), (12, 4, 128, 16)])
def test_extension_reads_pools_in_place(ext, codec, h, h_kv, d, bs, monkeypatch):
    """Prefill and decode rows over fp8 / int8 (open blocks included) / half pools equal the reference
    reading the same pool, and never go through LayerKV.gather (the codes are read where they lie)."""
    lens = [(1, 1), (1, 77), (1, 300), (1, 2 * bs), (1, 5 * bs + 3), (40, 40), (3 * bs + 1, 5 * bs + 3)]
    query, dense, meta = make_batch(lens, h, h_kv, d, bs, torch.float32, "mixed")
    kv = quantized_copy(dense, meta, codec, torch.float32)
    if codec == "int8":
        assert kv.open_k.slots, "the test needs open blocks"
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)
    monkeypatch.setattr(type(kv), "gather", lambda *a: pytest.fail("gather on the extension's path"))
    out = CpuPagedBackend().forward(query, kv, meta, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16])
def test_extension_half_queries_and_int8_half_shadow(ext, compute):
    query, dense, meta = make_batch([(1, 50), (1, 33), (20, 40)], 6, 2, 64, 16, compute, "shuffled")
    for kv in (dense, quantized_copy(dense, meta, "int8", compute)):
        ref = ReferenceBackend().forward(query, kv, meta, 0.125)
        out = CpuPagedBackend().forward(query, kv, meta, 0.125)
        assert out.dtype == compute
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=0)


def test_extension_splits_and_merge_across_threads(ext):
    """Two threads: long sequences in several splits (a decode row's splits in parallel items, merged
    afterwards; a prefill's folded as they go); a short sequence next to long ones; head_dim 256 too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for d in (64, 256):
            _check(
                [(1, 2000), (1, 3), (1, 700), (70, 1100)], 8, 2, d, 16, torch.float32, "shuffled", atol=2e-5
            )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d,bs", [(16, 16), (32, 16), (16, 8), (64, 64), (64, 128)])
def test_extension_head_dims_and_block_sizes(ext, d, bs):
    """Every head_dim the extension has (tiny-random-llama's 16 included) and block sizes below, at and
    above its 64-token softmax step."""
    _check(SHAPES["mixed"] + SHAPES["chunked_prefill"], 4, 2, d, bs, torch.float32, "mixed", atol=1e-5)


def test_unsupported_head_dim_takes_the_torch_path(ext, monkeypatch):
    monkeypatch.setattr(cpu_ext, "attention", lambda *a, **k: pytest.fail("extension called for head_dim 48"))
    _check([(1, 40), (3, 40)], 4, 2, 48, 16, torch.float32, "mixed", atol=1e-5)


def test_extension_rejects_bad_arguments(ext):
    query, kv, meta = make_batch([(1, 40)], 4, 2, 64, 16, torch.float32, "mixed")
    none = torch.empty(0, dtype=torch.int32)
    good = (
        query,
        kv.k_cache,
        kv.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        none,
        0.125,
        0,  # no sliding window
    )
    with pytest.raises(RuntimeError, match="block_tables must be a contiguous int32"):
        ext.paged_attention_dense(*good[:3], meta.block_tables.long(), *good[4:])
    with pytest.raises(RuntimeError, match="outside"):
        ext.paged_attention_dense(*good[:4], torch.tensor([10_000], dtype=torch.int32), *good[5:])
    with pytest.raises(RuntimeError, match="num_heads must be a multiple"):
        ext.paged_attention_dense(query[:, :3].contiguous(), *good[1:])
    with pytest.raises(RuntimeError, match="v_cache must be"):
        ext.paged_attention_dense(query, kv.k_cache, kv.v_cache.half(), *good[3:])
    with pytest.raises(RuntimeError, match="position 40 of row 0 is outside"):
        ext.paged_attention_dense(*good[:6], torch.tensor([40], dtype=torch.int32), 0.125, 0)
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0"):
        ext.paged_attention_dense(*good[:5], torch.tensor([0, 2], dtype=torch.int32), none, 0.125, 0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ext.paged_attention_dense(*good[:8], -1)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        q48 = torch.randn(1, 4, 48)
        k48 = torch.randn(kv.k_cache.shape[:3] + (48,))
        ext.paged_attention_dense(q48, k48, k48, *good[3:])


def test_extension_decodes_every_e4m3_code(ext):
    """fp8 codes are converted with integer operations (subnormals included): every finite code."""
    query, dense, meta = make_batch([(1, 64)], 4, 2, 64, 16, torch.float32, "shuffled")
    kv = quantized_copy(dense, meta, "fp8_e4m3", torch.float32)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for field in (kv.k_blocks.fields["codes"], kv.v_blocks.fields["codes"]):
        field.copy_(finite[torch.randint(len(finite), field.shape, generator=gen)])
    for field in (kv.k_blocks.fields["scale"], kv.v_blocks.fields["scale"]):
        field.fill_(0.01)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = CpuPagedBackend().forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
