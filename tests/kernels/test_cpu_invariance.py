"""Batch invariance of the CPU extension's kernels, bitwise (docs/kernels.md: the guarantee).

Attention (through CpuPagedBackend, every KV format): each row's output is the same whether its
sequence runs alone or packed with others in any order, its prompt in one call or split into pieces
(chunked prefill, a warm suffix) or row by row (decode), at explicit positions (PositionalBackend),
with 1 or 2 threads. Linear (through the model wrapper): each row's output is the same for any row
count, 1 to 40 and 300, and thread count. Parity with the reference / torch within tolerance.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.base import AttentionMetadata, SeqRows
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.positional import PositionalBackend
from kvserve.attention.reference import ReferenceBackend
from kvserve.attention.testing import make_batch, quantized_copy
from kvserve.kernels.cpu_features import has_amx_bf16
from kvserve.models.cpu_linear import wrap_linears
from tests.kernels.conftest import lanes_only

# (q_len, seq_len) per sequence: a whole prompt, a warm suffix, a decode row, a short prompt
LENS = [(600, 600), (40, 700), (1, 1300), (17, 17)]
SHAPES = {"tiny": (4, 2, 16), "smollm2": (9, 3, 64), "d128": (8, 2, 128)}
# int4 / turbo4: through a dense copy. bf16q: bf16 queries over a bf16 pool, the kernel's bf16 arithmetic
# (csrc/cpu/attention_math.h, Bf16Math) where head_dim / 2 fills whole vectors (not "tiny" on AVX-512).
FORMATS = ["fp32", "bf16", "bf16q", "fp8_e4m3", "int8", "int4", "turbo4"]


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def batch(shape: str, fmt: str, lens=LENS, seed: int = 0):
    h, h_kv, d = SHAPES[shape]
    query, dense, meta = make_batch(lens, h, h_kv, d, 16, torch.float32, "mixed", seed=seed)
    if fmt == "bf16q":
        return query.bfloat16(), quantized_copy(dense, meta, "bf16", torch.float32), meta, d**-0.5
    kv = dense if fmt == "fp32" else quantized_copy(dense, meta, fmt, torch.float32)
    return query, kv, meta, d**-0.5


def blocks_of(meta: AttentionMetadata, i: int) -> list[int]:
    """Sequence i's block ids (its row of the padded block table)."""
    return meta.block_tables[i, : -(-meta.seq_lens_list[i] // meta.block_size)].tolist()


def pieces_meta(
    query: torch.Tensor, meta: AttentionMetadata, pieces: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
    """A step whose sequences are `pieces` (sequence i's query rows [a, b), its KV up to its row b - 1):
    (query rows, metadata, the rows of the full batch they are)."""
    starts = meta.query_start_loc.tolist()
    rows, seqs = [], []
    for i, a, b in pieces:
        ctx = meta.seq_lens_list[i] - meta.query_lens_list[i]
        rows += range(starts[i] + a, starts[i] + b)
        seqs.append(SeqRows(blocks_of(meta, i), torch.arange(ctx + a, ctx + b), ctx + b))
    sub = AttentionMetadata.build(seqs, meta.block_size, "cpu", write=False)
    return query[rows].contiguous(), sub, rows


def assert_rows_equal(backend, query, kv, meta, scale, full, pieces, what):
    q, sub, rows = pieces_meta(query, meta, pieces)
    out = backend.forward(q, kv, sub, scale)
    differ = [r for r, o in zip(rows, out, strict=True) if not torch.equal(o, full[r])]
    assert not differ, (
        f"{what}: {len(differ)} of {len(rows)} rows differ from the whole batch, first row {differ[0]}"
    )


def plans(meta: AttentionMetadata) -> dict[str, list[list[tuple[int, int, int]]]]:
    """Other ways to run the same rows, each a list of calls, each call a list of pieces."""
    whole = [(i, 0, q) for i, q in enumerate(meta.query_lens_list)]
    return {
        "each sequence alone": [[p] for p in whole],
        "sequences packed in reverse order": [whole[::-1]],
        "prefill split at 1, 64, 100 and 513 (chunked prefill, warm suffixes)": [
            [(0, 0, 1)],
            [(0, 1, 64)],
            [(0, 64, 100), (1, 0, 40)],
            [(0, 100, 513), (2, 0, 1)],
            [(0, 513, 600)],
        ],
        "rows one by one, packed (decode)": [
            [(0, j, j + 1) for j in range(0, 600, 7)] + [(1, j, j + 1) for j in range(40)]
        ],
        "last rows alone (a full hit recomputing one token)": [[(0, 599, 600)], [(1, 39, 40)], [(3, 16, 17)]],
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_attention_rows_are_batch_invariant(ext, shape, fmt):
    query, kv, meta, scale = batch(shape, fmt)
    backend = CpuPagedBackend()
    full = backend.forward(query, kv, meta, scale)
    for what, calls in plans(meta).items():
        for pieces in calls:
            assert_rows_equal(backend, query, kv, meta, scale, full, pieces, what)


@pytest.mark.parametrize("fmt", ["fp32", "bf16q", "fp8_e4m3", "int8"])
def test_attention_is_thread_count_invariant(ext, fmt):
    query, kv, meta, scale = batch("smollm2", fmt, lens=[(300, 300), (1, 2000), (1, 700), (5, 1500)])
    with threads(1):
        one = CpuPagedBackend().forward(query, kv, meta, scale)
    with threads(2):
        two = CpuPagedBackend().forward(query, kv, meta, scale)
    assert torch.equal(one, two)


def shared_prefix_decode(fmt: str, shared_blocks: int):
    """Six decode rows whose sequences hold the same first `shared_blocks` blocks (a cached prefix used by
    several requests) and blocks of their own after it, at different lengths: (query, kv, meta, scale)."""
    lens = [(1, 1300), (1, 1100), (1, 1500), (1, 1030), (1, 2100), (1, 1300)]
    query, kv, meta, scale = batch("smollm2", fmt, lens=lens, seed=3)
    prefix = blocks_of(meta, 0)[:shared_blocks]
    seqs = [
        SeqRows(prefix + blocks_of(meta, i)[shared_blocks:], torch.tensor([seq_len - 1]), seq_len)
        for i, (_, seq_len) in enumerate(lens)
    ]
    return query, kv, AttentionMetadata.build(seqs, meta.block_size, "cpu", write=False), scale


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "bf16q", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("shared_blocks", [64, 70])
def test_decode_rows_sharing_a_prefix_equal_each_alone(ext, fmt, shared_blocks):
    """Splits that several decoding sequences hold in the same blocks are one work item for all of them
    (csrc/cpu/paged_attention.h, plan_items): each row is still bitwise its result alone, with 1 or 2
    threads, and matches the reference."""
    query, kv, meta, scale = shared_prefix_decode(fmt, shared_blocks)
    backend = CpuPagedBackend()
    with threads(2):
        together = backend.forward(query, kv, meta, scale)
    for n in (1, 2):
        with threads(n):
            for i in range(len(meta.seq_lens_list)):
                _, sub, rows = pieces_meta(query, meta, [(i, 0, 1)])
                alone = backend.forward(query[rows].contiguous(), kv, sub, scale)
                assert torch.equal(alone[0], together[i]), f"row {i}, {n} thread(s)"
    assert_matches_reference(together, query, kv, meta, scale)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "turbo4"])
def test_rows_at_explicit_positions_equal_the_prefill_rows(ext, fmt):
    """Content-reuse repair recomputes rows at chosen positions (PositionalBackend): bitwise the rows of
    the plain prefill of the same sequence."""
    query, kv, meta, scale = batch("smollm2", fmt, lens=[(300, 300)])
    full = CpuPagedBackend().forward(query, kv, meta, scale)
    positions = torch.tensor([0, 5, 15, 16, 17, 63, 64, 200, 299])
    rows = SeqRows(blocks_of(meta, 0), positions, meta.seq_lens_list[0])
    sub = AttentionMetadata.build([rows], meta.block_size, "cpu", write=False, explicit_positions=True)
    out = PositionalBackend().forward(query[positions].contiguous(), kv, sub, scale)
    assert torch.equal(out, full[positions])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_matches_the_reference(ext, shape, fmt):
    query, kv, meta, scale = batch(shape, fmt, lens=[(70, 70), (9, 140), (1, 1300), (1, 5)], seed=1)
    out = CpuPagedBackend().forward(query, kv, meta, scale)
    assert_matches_reference(out, query, kv, meta, scale)


def assert_matches_reference(out, query, kv, meta, scale):
    """Within fp32 rounding of the reference; for bf16 queries, of the reference's fp32 arithmetic over the
    same bf16 values, within the bf16 arithmetic's two roundings: probabilities (sum |dp| |v| / l <= 2^-9
    max |v|) and the output's (2^-9 |out| <= 2^-9 max |v|)."""
    ref = ReferenceBackend().forward(query.float(), kv, meta, scale)
    if query.dtype == torch.bfloat16:
        blocks = torch.unique(meta.block_tables[meta.block_tables >= 0]).long()
        atol = 2**-8 * kv.gather(blocks)[1].float().abs().max().item()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    else:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def wrapped(ext, out_features: int, in_features: int, bias: bool, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(out_features + in_features)
    layer = nn.Sequential(nn.Linear(in_features, out_features, bias=bias)).to(dtype)
    assert wrap_linears(layer, ext) == 1
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (192, 576), (37, 100), (5, 7), (1536, 64)])
def test_linear_rows_are_row_count_invariant(ext, out_f, in_f, dtype):
    """Every row of a 300-row call equals the same row computed in calls of 1 to 40 rows (decode steps,
    small batches, prefill slices), at several offsets, with 1 and 2 threads; fp32 and bf16."""
    layer = wrapped(ext, out_f, in_f, bias=True, dtype=dtype)
    x = torch.randn(300, in_f, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad(), threads(1):
        full = layer(x)
        for rows in range(1, 41):
            for at in (0, 300 - rows, (7 * rows) % (300 - rows)):
                assert torch.equal(layer(x[at : at + rows]), full[at : at + rows]), (rows, at)
        assert torch.equal(layer(x.view(3, 100, in_f)).view(300, out_f), full)
    with torch.no_grad(), threads(2):
        assert torch.equal(layer(x), full)
        assert torch.equal(layer(x[:3]), full[:3])


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300])
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (100, 37), (7, 3), (49, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(ext, rows, out_f, in_f, bias):
    layer = wrapped(ext, out_f, in_f, bias)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
    lin = layer[0].linear
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, lin.weight, lin.bias), atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300])
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (100, 37), (7, 3), (49, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_linear_is_the_fp32_sum_rounded_once(ext, rows, out_f, in_f, bias):
    """row_linear_bf16 = the exact product of the bf16 inputs summed in fp32, plus the bias, rounded to
    bf16 once: within one bf16 rounding (plus fp32 summation error) of the float64 result, which torch's
    bf16 linear is not always (it may round partial sums)."""
    layer = wrapped(ext, out_f, in_f, bias, dtype=torch.bfloat16)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).bfloat16()
    lin = layer[0].linear
    exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding: |error| <= 2^-8 |y|; the fp32 sum adds about in_f * 2^-24 * sum |x w|
    bound = exact.abs() * 2**-8 + in_f * 2**-23 * (x.double().abs() @ lin.weight.double().abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX-BF16")
def test_bf16_attention_runs_on_amx_tiles_where_the_cpu_has_them(ext):
    assert ext.attention_amx(64) and ext.attention_amx(128) and ext.attention_amx(256)
    assert not ext.attention_amx(16)  # a query tile needs 16 channel pairs
    with lanes_only(ext):
        assert not ext.attention_amx(64)


@pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("shape", ["smollm2", "d128"])
@pytest.mark.parametrize("window", [None, 50])
def test_amx_attention_equals_the_lanes_within_the_bf16_roundings(ext, shape, window):
    """The tiles (fast path) against the vdpbf16ps chains (its reference) on prefill, chunked prefill and
    decode rows, with and without a sliding window: both are the bf16 arithmetic with fp32 sums in
    different orders, so they agree within its roundings (the reference test's bound), and (with no window) differ."""
    query, kv, meta, scale = batch(shape, "bf16q", lens=[(70, 70), (9, 140), (1, 1300), (1, 5)], seed=3)
    tiles = CpuPagedBackend().forward(query, kv, meta, scale, window)
    with lanes_only(ext):
        lanes = CpuPagedBackend().forward(query, kv, meta, scale, window)
    blocks = torch.unique(meta.block_tables[meta.block_tables >= 0]).long()
    atol = 2**-7 * kv.gather(blocks)[1].float().abs().max().item()
    torch.testing.assert_close(tiles.float(), lanes.float(), atol=atol, rtol=0)
    if window is None:  # the tiles ran: their sums round differently somewhere (with a 50-token window the
        # smollm2 shape's outputs came out bitwise equal on an AMX Xeon of model 167, 2026-12-06)
        assert not torch.equal(tiles, lanes)


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_attention_rejects_a_scale_that_is_not_positive(ext, scale):
    """The AMX softmax takes the step max of the raw scores and scales it once, which holds only for a
    positive scale: the kernel refuses any other rather than answer wrongly."""
    q, kv, meta = make_batch([(20, 20)], 4, 2, 64, 16, torch.bfloat16, layout="contiguous")
    args = (
        meta.block_tables.int(),
        meta.seq_lens.int(),
        meta.query_start_loc.int(),
        torch.zeros(0, dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match="scale must be positive"):
        ext.paged_attention_dense(q, kv.k_cache, kv.v_cache, *args, scale, 0)
    assert torch.isfinite(ext.paged_attention_dense(q, kv.k_cache, kv.v_cache, *args, 0.125, 0).float()).all()
