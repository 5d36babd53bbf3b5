"""Triton kernels against the reference backend, under the CPU interpreter (or on a GPU if present),
plus a compile of every kernel for sm_90 and sm_80 with no GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # the interpreter is chosen when @triton.jit runs, so before the kernel modules are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvserve.attention.reference import ReferenceBackend  # noqa: E402
from kvserve.attention.testing import make_batch  # noqa: E402
from kvserve.attention.triton_backend import TritonBackend  # noqa: E402
from kvserve.kernels.triton.kv_formats import (  # noqa: E402
    e2m1_to_fp16,
    e4m3_native_to_fp16,
    e4m3_to_fp16,
    e4m3_to_fp32,
    e8m0_to_fp32,
    mxfp4_tile,
)

pytestmark = pytest.mark.triton
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}

SHAPES = {
    "prefill": [(37, 37), (80, 80)],
    "chunked_prefill": [(9, 70), (70, 200)],
    "decode": [(1, 1), (1, 77), (1, 150)],
    "mixed": [(1, 50), (20, 20), (7, 60)],
}


def _to_device(query, kv, meta):
    """Moves a CPU-built batch to the GPU in place (the reference runs on the CPU copy first)."""
    if ON_GPU:
        kv.k_cache, kv.v_cache = kv.k_cache.cuda(), kv.v_cache.cuda()
        meta.block_tables, meta.query_start_loc = meta.block_tables.cuda(), meta.query_start_loc.cuda()
        meta.seq_lens = meta.seq_lens.cuda()
    return query.to(DEVICE)


def _check(lens, h, h_kv, d, bs, dtype, layout="mixed"):
    query, kv, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout)
    scale = d**-0.5
    ref = ReferenceBackend().forward(query, kv, meta, scale)
    query = _to_device(query, kv, meta)
    out = TritonBackend().forward(query, kv, meta, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parity_kinds(kind, dtype):
    _check(SHAPES[kind], 6, 2, 64, 16, dtype)


@pytest.mark.parametrize("h,h_kv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("kind", ["chunked_prefill", "decode"])
def test_parity_gqa(h, h_kv, kind):
    _check(SHAPES[kind], h, h_kv, 64, 16, torch.float16)


@pytest.mark.parametrize("d,bs", [(128, 16), (64, 32), (128, 32)])
def test_parity_head_dim_block_size(d, bs):
    _check([(1, 40), (9, 30)], 4, 2, d, bs, torch.bfloat16, layout="shuffled")
    _check([(1, 1), (1, 90)], 4, 2, d, bs, torch.bfloat16, layout="shuffled")


def test_decode_many_splits():
    """Small splits: many partials per sequence, some empty for the shorter sequences."""
    from kvserve.kernels.triton.paged_decode import paged_decode

    query, kv, meta = make_batch([(1, 3), (1, 200), (1, 64)], 4, 2, 64, 16, torch.float16, "shuffled")
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    query = _to_device(query, kv, meta)
    args = (query, kv.k_cache, kv.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    out = paged_decode(*args, max_seq_len=200, scale=0.125, block_n=16, target_programs=64)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-3, rtol=0)


def test_launcher_rejects_bad_args():
    from kvserve.kernels.triton.paged_prefill import paged_prefill

    query, kv, meta = make_batch([(4, 4)], 4, 2, 64, 16, torch.float16, "contiguous")
    args = [query, kv.k_cache, kv.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens]
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_prefill(query.float(), *args[1:], max_query_len=4, scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill(*args[:3], meta.block_tables.long(), *args[4:], max_query_len=4, scale=1.0)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        paged_prefill(
            query[..., :32], kv.k_cache[..., :32], kv.v_cache[..., :32], *args[3:], max_query_len=4, scale=1.0
        )


def test_compiles_for_sm90_and_sm80_without_gpu():
    """triton.compile(..., target=GPUTarget("cuda", arch, 32)) for every kernel, in a fresh process
    (this one may have imported the kernels under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.kernels.triton.compile_check", "--arch", "90", "80", "--quick"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip(f"this triton cannot compile for a target without a GPU: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # prefill{,-window,-fp8kv,-fp8kv-fp32}, decode{,-fp8kv,-int8kv,-mxfp4kv}, merge, nested-{fp8,fp16}{,-swap}; sm_90
    # also the two fp8kv-native variants (the hardware conversion, sm_89 and later)
    for arch, count in ((90, 15), (80, 13)):
        assert proc.stdout.count(f"ok   sm_{arch}") == count, proc.stdout
    assert "decode-int8kv" in proc.stdout and "decode-mxfp4kv" in proc.stdout
    assert "prefill-fp8kv-native" in proc.stdout and "decode-fp8kv-native" in proc.stdout
    assert "prefill-fp8kv-fp32" in proc.stdout and "nested-fp16-swap" in proc.stdout


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "mxfp4"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_quantized_pool(codec, kind):
    """fp8, int8 and mxfp4 decode read codes and scales in place; prefill steps read fp8 in place and
    take a dense copy of int8 and mxfp4."""
    quant_storage = pytest.importorskip("kvserve.kvcache.quantized_storage")
    lens = [(1, 40), (1, 9)] if kind == "decode" else [(1, 30), (6, 20)]
    query, dense, meta = make_batch(lens, 8, 2, 64, 16, torch.float16, "shuffled")
    kv = quant_storage.create_layer_kv(codec, dense.num_blocks, 16, 2, 64, torch.float16)
    kv.write(
        torch.arange(dense.num_blocks * 16), dense.k_cache.view(-1, 2, 64), dense.v_cache.view(-1, 2, 64)
    )
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)  # reads the same dequantized values
    if ON_GPU:
        pytest.skip("the quantized pool is built on the CPU here")
    out = TritonBackend().forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=0)


def _int8_pool(lens, h, h_kv, d, bs, dtype, layout="shuffled", seed=0):
    """make_batch's KV written into an int8 KIVI pool token by token in sequence order, as serving
    does: full blocks close (K per-channel codes), each sequence's last partial block stays open
    (K in its full-precision shadow). -> query, QuantizedLayerKV, meta (all on the CPU)."""
    from kvserve.kvcache.block_pool import slot_mapping
    from kvserve.kvcache.quantized_storage import create_layer_kv

    query, dense, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout, seed)
    kv = create_layer_kv("int8", dense.num_blocks, bs, h_kv, d, dtype)
    k_src, v_src = dense.k_cache.view(-1, h_kv, d), dense.v_cache.view(-1, h_kv, d)
    for i, seq_len in enumerate(meta.seq_lens_list):
        slots = slot_mapping(meta.block_tables[i], torch.arange(seq_len), bs)
        cut = max(1, seq_len // 2)  # two writes: a prompt, then the rest (shadows carry across)
        for part in (slots[:cut], slots[cut:]):
            kv.write(part, k_src[part], v_src[part])
    return query, kv, meta


def _quantized_forward(query, kv, meta, scale, window=None, **launch):
    """TritonBackend on a QuantizedLayerKV (or paged_decode with launch options, the operands from
    paged_kv); on a GPU, a device copy."""
    if ON_GPU:
        for blocks in (kv.k_blocks, kv.v_blocks):
            blocks.fields = {name: t.cuda() for name, t in blocks.fields.items()}
        kv.open_k.pool, kv.open_k.slot_of_block = kv.open_k.pool.cuda(), kv.open_k.slot_of_block.cuda()
        meta.block_tables, meta.query_start_loc = meta.block_tables.cuda(), meta.query_start_loc.cuda()
        meta.seq_lens = meta.seq_lens.cuda()
        query = query.cuda()
    if not launch:
        return TritonBackend().forward(query, kv, meta, scale, window).cpu()
    from kvserve.kernels.paged_kv import paged_kv
    from kvserve.kernels.triton.paged_decode import paged_decode

    f = paged_kv(kv)
    assert f is not None
    out = paged_decode(
        query, f.k_cache, f.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        max_seq_len=meta.max_seq_len, scale=scale, k_scale=f.k_scale, v_scale=f.v_scale, k_zero=f.k_zero,
        v_zero=f.v_zero, k_open=f.k_open, k_open_slot=f.k_open_slot, **launch,
    )  # fmt: skip
    return out.cpu()


INT8_LENS = [(1, 1), (1, 40), (1, 64), (1, 77)]  # open-only, open + closed, all closed (64 = 4*16 = 2*32)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_int8_decode_in_place_parity(h, h_kv, d, bs):
    query, kv, meta = _int8_pool(INT8_LENS, h, h_kv, d, bs, torch.float16)
    open_blocks, closed = set(kv.open_k.slots), kv.closed
    assert open_blocks and closed and not open_blocks & closed  # both kinds are read
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)
    out = _quantized_forward(query, kv, meta, d**-0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.float16], rtol=0)


@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32)])
def test_int8_decode_in_place_bf16(d, bs):
    query, kv, meta = _int8_pool(INT8_LENS, 6, 2, d, bs, torch.bfloat16, layout="mixed")
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)
    out = _quantized_forward(query, kv, meta, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("block_n,bs", [(64, 16), (16, 32)])  # 4 blocks per tile; 2 tiles per block
def test_int8_decode_tile_shapes_and_splits(block_n, bs):
    """Tiles spanning several blocks (per-block K scales broadcast inside a tile) and tiles inside
    one block, with many splits (some empty for the short sequences)."""
    query, kv, meta = _int8_pool([(1, 3), (1, 150), (1, 64)], 4, 2, 64, bs, torch.float16)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = _quantized_forward(query, kv, meta, 0.125, block_n=block_n, target_programs=64, num_warps=4)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


def test_int8_decode_reads_codes_in_place(monkeypatch):
    """The decode path never dequantizes through the pool's Python API: gather, the packed-block
    read and the dense copy all raise. Open blocks hold stale codes, scales and zeros (as a reused
    block would), which the kernel must ignore in favour of the shadow."""
    from kvserve.attention import triton_backend
    from kvserve.kvcache.packed_blocks import PackedBlocks
    from kvserve.kvcache.quantized_storage import QuantizedLayerKV

    query, kv, meta = _int8_pool([(1, 40), (1, 33)], 6, 2, 64, 16, torch.float16)
    open_blocks = torch.tensor(sorted(kv.open_k.slots))
    gen = torch.Generator().manual_seed(1)
    fields = kv.k_blocks.fields
    fields["codes"][open_blocks] = torch.randint(
        0, 256, fields["codes"][open_blocks].shape, generator=gen
    ).to(torch.uint8)
    fields["scale"][open_blocks] = 0.5
    fields["zero"][open_blocks] = -3.0
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)

    def boom(*args, **kwargs):
        raise AssertionError("int8 decode must read the pool in place")

    monkeypatch.setattr(kv, "gather", boom)
    monkeypatch.setattr(QuantizedLayerKV, "gather", boom)
    monkeypatch.setattr(PackedBlocks, "read", boom)
    monkeypatch.setattr(triton_backend, "dense_copy", boom)
    out = _quantized_forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


def test_int8_decode_without_open_blocks():
    """Every block closed and a shadow pool of 0 rows: the launcher passes a stand-in pointer."""
    query, kv, meta = _int8_pool([(1, 32), (1, 64)], 4, 2, 64, 16, torch.float16)
    assert not kv.open_k.slots and bool((kv.open_k.slot_of_block == -1).all())
    kv.open_k.pool = kv.open_k.pool[:0]
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = _quantized_forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


def test_int8_launcher_rejects_bad_fields():
    from kvserve.kernels.paged_kv import paged_kv
    from kvserve.kernels.triton.paged_decode import paged_decode

    query, kv, meta = _int8_pool([(1, 20)], 4, 2, 64, 16, torch.float16)
    f = paged_kv(kv)
    assert f is not None
    args = (query, f.k_cache, f.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    fields = dict(
        k_scale=f.k_scale, v_scale=f.v_scale, k_zero=f.k_zero, v_zero=f.v_zero, k_open=f.k_open,
        k_open_slot=f.k_open_slot,
    )  # fmt: skip
    with pytest.raises(ValueError, match="int8 caches need k_open"):
        paged_decode(*args, max_seq_len=20, scale=1.0, **dict(fields, k_open=None))
    with pytest.raises(ValueError, match="k_open must be torch.float16"):
        paged_decode(*args, max_seq_len=20, scale=1.0, **dict(fields, k_open=f.k_open.float()))
    with pytest.raises(ValueError, match="k_scale must be float16"):
        paged_decode(*args, max_seq_len=20, scale=1.0, **dict(fields, k_scale=f.k_scale.float()))
    with pytest.raises(ValueError, match="v_zero must be"):
        paged_decode(*args, max_seq_len=20, scale=1.0, **dict(fields, v_zero=f.v_zero[..., :0]))
    with pytest.raises(ValueError, match="k_open_slot must be int32"):
        paged_decode(*args, max_seq_len=20, scale=1.0, **dict(fields, k_open_slot=f.k_open_slot.long()))


@triton.jit
def _convert_e4m3_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_to_fp16(tl.load(codes_ptr + offs)))


@triton.jit
def _convert_e4m3_native_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_native_to_fp16(tl.load(codes_ptr + offs)))


@triton.jit
def _convert_e4m3_fp32_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_to_fp32(tl.load(codes_ptr + offs)))


@pytest.mark.parametrize(
    "kernel", [_convert_e4m3_kernel, _convert_e4m3_native_kernel, _convert_e4m3_fp32_kernel]
)
def test_e4m3_conversions_are_exact(kernel):
    """The integer bit tricks (to fp16, to fp32: subnormal codes too) and the hardware conversion
    (sm_89+; the interpreter emulates it)."""
    if kernel is _convert_e4m3_native_kernel and ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no hardware fp8 conversion before sm_89")
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN codes
    codes = torch.cat([codes, codes[:2]])  # 256 lanes
    dtype = torch.float32 if kernel is _convert_e4m3_fp32_kernel else torch.float16
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    kernel[(1,)](codes.to(DEVICE), out, 256)
    assert torch.equal(out.cpu().float(), codes.view(torch.float8_e4m3fn).float())


def _fp8_pool(lens, h, h_kv, d, bs, dtype, layout="shuffled", seed=0):
    """make_batch's KV written into an fp8_e4m3 pool, slot by slot. -> query, QuantizedLayerKV, meta
    (all on the CPU)."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    query, dense, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout, seed)
    kv = create_layer_kv("fp8_e4m3", dense.num_blocks, bs, h_kv, d, dtype)
    kv.write(
        torch.arange(dense.num_blocks * bs), dense.k_cache.view(-1, h_kv, d), dense.v_cache.view(-1, h_kv, d)
    )
    return query, kv, meta


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kind", ["prefill", "chunked_prefill", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_prefill_reads_codes_in_place(monkeypatch, kind, dtype, native):
    """Prefill and mixed steps over an fp8 pool read codes and scales in place (no dense copy), with
    either fp8 conversion, and equal the reference over the same dequantized values."""
    import kvserve.attention.triton_backend as tb
    from kvserve.kernels.triton import paged_decode, paged_prefill

    if native and ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no hardware fp8 conversion before sm_89")
    query, kv, meta = _fp8_pool(SHAPES[kind], 8, 2, 64, 16, dtype)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    monkeypatch.setattr(tb, "dense_copy", lambda *a: pytest.fail("fp8 prefill took a dense copy"))
    for module in (paged_decode, paged_prefill):
        monkeypatch.setattr(module, "native_fp8", lambda device: native)
    out = _quantized_forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_prefill_conversions_and_launches_agree(dtype):
    """Every fp8 conversion decodes the same values, so the prefill's output is the same bit for bit;
    another tile shape, warp count or stage count changes only the summation order (a few ulps)."""
    from kvserve.kernels.triton.paged_prefill import FP8_CONVERTS, paged_prefill

    if ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no hardware fp8 conversion before sm_89")
    query, kv, meta = _fp8_pool(SHAPES["chunked_prefill"], 8, 2, 64, 16, dtype)
    from kvserve.kernels.paged_kv import paged_kv

    pool = paged_kv(kv, dtype)
    query = query.to(DEVICE)
    args = [
        t.to(DEVICE)
        for t in (pool.k_cache, pool.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    ]
    scales = dict(k_scale=pool.k_scale.to(DEVICE), v_scale=pool.v_scale.to(DEVICE))

    def run(**launch):
        return paged_prefill(query, *args, max_query_len=meta.max_query_len, scale=0.125, **scales, **launch)

    base = run(fp8_convert="bits")
    for convert in FP8_CONVERTS[1:]:
        assert torch.equal(run(fp8_convert=convert), base), convert
    other = run(block_m=32, block_n=32, num_warps=8, num_stages=2)
    torch.testing.assert_close(other.float(), base.float(), atol=TOL[dtype], rtol=0)
    with pytest.raises(ValueError, match="fp8_convert must be one of"):
        run(fp8_convert="cvt")


@pytest.mark.parametrize("fmt", ["dense", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("window", [1, 9, 40, 5000])
def test_sliding_window_matches_the_reference(fmt, window):
    """A sliding-window layer's every step (prefill, chunked prefill, decode and mixed rows) through
    the prefill kernel, dense and fp8 pools in place, int8 through a dense copy: a row at p sees
    (p - window, p], as the reference masks it; rows whose window starts past a tile see nothing there."""
    lens = [(37, 37), (9, 70), (1, 150), (20, 20)]
    if fmt == "dense":
        query, kv, meta = make_batch(lens, 8, 2, 64, 16, torch.float32, "shuffled")
    elif fmt == "fp8_e4m3":
        query, kv, meta = _fp8_pool(lens, 8, 2, 64, 16, torch.float32)
    else:
        from kvserve.attention.testing import quantized_copy

        query, dense, meta = make_batch(lens, 8, 2, 64, 16, torch.float32, "shuffled")
        kv = quantized_copy(dense, meta, "int8", torch.float32)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125, window)
    if fmt == "dense":
        out = TritonBackend().forward(_to_device(query, kv, meta), kv, meta, 0.125, window).cpu()
    else:
        out = _quantized_forward(query, kv, meta, 0.125, window=window)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)


def test_fp8_prefill_rejects_bad_scales():
    from kvserve.kernels.triton.paged_prefill import paged_prefill

    query, kv, meta = _fp8_pool([(5, 20)], 4, 2, 64, 16, torch.float16)
    f = kv.kernel_view()
    args = (query, f.k_cache, f.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    with pytest.raises(ValueError, match="v_scale is required"):
        paged_prefill(*args, max_query_len=5, scale=1.0, k_scale=f.k_scale)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        paged_prefill(*args, max_query_len=5, scale=1.0, k_scale=f.k_scale.half(), v_scale=f.v_scale)


def _mxfp4_pool(lens, h, h_kv, d, bs, dtype, layout="shuffled", seed=0):
    """make_batch's KV, each group of 32 channels scaled by 2^k (k in [-6, 0]) so that the groups get
    different UE8M0 exponents, written into an mxfp4 pool slot by slot, the garbage past each
    sequence's end included (a kernel reading past seq_len shows up). -> query, QuantizedLayerKV,
    meta (all on the CPU)."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    query, dense, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    group_scale = torch.exp2(torch.randint(-6, 1, (2, h_kv, d // 32, 1), generator=gen).float())
    group_scale = group_scale.expand(-1, -1, -1, 32).reshape(2, h_kv, d)
    kv = create_layer_kv("mxfp4", dense.num_blocks, bs, h_kv, d, dtype)
    k_src, v_src = dense.k_cache.view(-1, h_kv, d).float(), dense.v_cache.view(-1, h_kv, d).float()
    kv.write(torch.arange(dense.num_blocks * bs), k_src * group_scale[0], v_src * group_scale[1])
    return query, kv, meta


MXFP4_LENS = [(1, 1), (1, 77), (1, 150)]  # one token; ends mid-block; several splits' worth


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mxfp4_decode_in_place_parity(dtype, d, bs):
    query, kv, meta = _mxfp4_pool(MXFP4_LENS, 8, 2, d, bs, dtype)
    assert len(set(kv.k_blocks.fields["scale"].flatten().tolist())) > 4  # many exponents are read
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)  # reads the same dequantized values
    out = _quantized_forward(query, kv, meta, d**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_mxfp4_decode_gqa(h, h_kv):
    query, kv, meta = _mxfp4_pool(MXFP4_LENS, h, h_kv, 64, 16, torch.float16, layout="mixed")
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = _quantized_forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.float16], rtol=0)


@pytest.mark.parametrize("block_n,bs", [(64, 16), (64, 32)])  # 4 and 2 blocks per tile
def test_mxfp4_decode_tile_shapes_and_splits(block_n, bs):
    """Many splits (some empty for the short sequences), tiles spanning several blocks."""
    query, kv, meta = _mxfp4_pool([(1, 3), (1, 150), (1, 64)], 4, 2, 128, bs, torch.bfloat16)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    out = _quantized_forward(query, kv, meta, 0.125, block_n=block_n, target_programs=64, num_warps=4)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=0)


def test_mxfp4_decode_takes_the_gpu_checked_tile_only():
    """block_n 16 gave wrong tiles on an H200 (Triton 3.6) though right here: the launcher refuses it."""
    query, kv, meta = _mxfp4_pool([(1, 40)], 4, 2, 128, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="block_n 64 only"):
        _quantized_forward(query, kv, meta, 0.125, block_n=16, target_programs=64, num_warps=4)


def test_mxfp4_decode_reads_codes_in_place(monkeypatch):
    """paged_kv hands the kernel the pool's own code and exponent tensors, and the decode path
    never dequantizes through the pool's Python API: gather, the packed-block read and the dense
    copy all raise."""
    from kvserve.attention import triton_backend
    from kvserve.kernels.paged_kv import paged_kv
    from kvserve.kvcache.packed_blocks import PackedBlocks
    from kvserve.kvcache.quantized_storage import QuantizedLayerKV

    query, kv, meta = _mxfp4_pool([(1, 40), (1, 33)], 6, 2, 64, 16, torch.float16)
    view = paged_kv(kv, torch.float16)
    assert view is not None and view.kv_format == "mxfp4"
    k, v = kv.k_blocks.fields, kv.v_blocks.fields
    assert view.k_cache is k["codes"] and view.v_cache is v["codes"]
    assert view.k_scale is k["scale"] and view.v_scale is v["scale"]
    assert view.k_cache.shape == (kv.num_blocks, 16, 2, 32)  # [.., D / 2]: two codes a byte
    assert view.k_scale.shape == (kv.num_blocks, 16, 2, 2)  # [.., D / 32]: one exponent a group
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)

    def boom(*args, **kwargs):
        raise AssertionError("mxfp4 decode must read the pool in place")

    monkeypatch.setattr(kv, "gather", boom)
    monkeypatch.setattr(QuantizedLayerKV, "gather", boom)
    monkeypatch.setattr(PackedBlocks, "read", boom)
    monkeypatch.setattr(triton_backend, "dense_copy", boom)
    out = _quantized_forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)


def test_mxfp4_launcher_rejects_bad_scales():
    from kvserve.kernels.paged_kv import paged_kv
    from kvserve.kernels.triton.paged_decode import paged_decode

    query, kv, meta = _mxfp4_pool([(1, 20)], 4, 2, 64, 16, torch.float16)
    f = paged_kv(kv)
    assert f is not None
    args = (query, f.k_cache, f.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    with pytest.raises(ValueError, match=r"v_scale must be \(3, 16, 2, 2\)"):
        paged_decode(*args, max_seq_len=20, scale=1.0, k_scale=f.k_scale, v_scale=f.v_scale[..., :1])
    with pytest.raises(ValueError, match="v_scale is required"):
        paged_decode(*args, max_seq_len=20, scale=1.0, k_scale=f.k_scale)
    with pytest.raises(ValueError, match="query head_dim 64 != cache head_dim 32"):  # codes read as fp8
        paged_decode(*args, max_seq_len=20, scale=1.0, k_scale=f.k_scale.float(), v_scale=f.v_scale.float())


@triton.jit
def _convert_mxfp4_kernel(codes_ptr, exponents_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = e2m1_to_fp16(tl.load(codes_ptr + offs)).to(tl.float32) * e8m0_to_fp32(tl.load(exponents_ptr + offs))
    tl.store(out_ptr + offs, x)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # 6 * 2^127: inf
def test_e2m1_and_e8m0_bit_tricks_are_exact():
    """Every 4-bit code times every exponent the codec writes (0..254), against its decoder."""
    from kvserve.quant.fp4 import UE8M0_BIAS, decode_e2m1

    codes = torch.arange(16, dtype=torch.uint8).repeat(255)
    exponents = torch.arange(255, dtype=torch.uint8).repeat_interleave(16)
    codes, exponents = torch.cat([codes, codes[:16]]), torch.cat([exponents, exponents[:16]])  # 4096 lanes
    out = torch.empty(4096, dtype=torch.float32, device=DEVICE)
    _convert_mxfp4_kernel[(1,)](codes.to(DEVICE), exponents.to(DEVICE), out, 4096)
    expected = decode_e2m1(codes) * torch.exp2(exponents.float() - UE8M0_BIAS)
    assert torch.equal(out.cpu(), expected)


@triton.jit
def _mxfp4_tile_kernel(codes_ptr, scale_ptr, out_ptr, N: tl.constexpr, HEAD_DIM: tl.constexpr):
    offs_n = tl.arange(0, N)
    ok = offs_n < N
    rows, scale_rows = offs_n * (HEAD_DIM // 2), offs_n * (HEAD_DIM // 32)  # (block, token, head) rows
    x = mxfp4_tile(codes_ptr, scale_ptr, rows, scale_rows, ok, out_ptr.dtype.element_ty, N, HEAD_DIM)
    tl.store(out_ptr + offs_n[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], x)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 infinities
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_mxfp4_tile_is_gather_bit_for_bit(dtype, d):
    """The kernel's dequantized tile equals what QuantizedLayerKV.gather hands the reference, bit for
    bit, over groups from 2^-30 to 2^15 (fp16 subnormals and infinities included)."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, d // 32, 32, generator=gen)  # 4 blocks of 16 tokens, 2 KV heads: 128 rows
    group_scale = torch.exp2(torch.randint(-30, 16, (64, 2, d // 32, 1), generator=gen).float())
    x = (x * group_scale).flatten(-2)
    kv = create_layer_kv("mxfp4", 4, 16, 2, d, dtype)
    kv.write(torch.arange(64), x, x)
    expected, _ = kv.gather(torch.arange(4))
    out = torch.empty(128, d, dtype=dtype, device=DEVICE)
    fields = kv.k_blocks.fields
    _mxfp4_tile_kernel[(1,)](fields["codes"].to(DEVICE), fields["scale"].to(DEVICE), out, 128, d)
    assert torch.equal(out.cpu(), expected.reshape(128, d))


ORDER_SCRIPT = """
import os, sys, torch
import kvserve.llm  # imports triton (through torch) before TRITON_INTERPRET is set (import kvserve alone is lazy)
assert "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"
from kvserve.attention.reference import ReferenceBackend
from kvserve.attention.triton_backend import TritonBackend
from kvserve.attention.testing import make_batch
for lens in ([(1, 40)], [(5, 20)]):
    q, kv, meta = make_batch(lens, 4, 2, 64, 16, torch.float16, "mixed")
    err = (TritonBackend().forward(q, kv, meta, 0.125) - ReferenceBackend().forward(q, kv, meta, 0.125)).abs().max()
    assert err < 2e-3, err
"""


@pytest.mark.skipif(ON_GPU, reason="interpreter only")
def test_interpreter_works_when_triton_was_imported_first():
    """Regression: tl.max / tl.sum / tl.zeros bound at `import triton` broke interpreted kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", ORDER_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
