"""CUDA extension: nvcc compile check of every kernel file (no GPU needed), availability on CPU,
and parity against the reference backend on a GPU (marked gpu + cuda_ext).

8-bit pools (fp8_e4m3, int8 KIVI), without a GPU: the launcher's argument checks and CudaBackend's
routing (in place vs dense copy, against a torch emulation of the kernel's format reading), and the
kernel's own K/V tile loads (csrc/attention/kv_tile.cuh) built for the CPU with nvcc and run thread
by thread against kvserve's decoders. With a GPU: parity of fp8 / int8 pools against the reference."""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.attention.reference import ReferenceBackend
from kvserve.attention.testing import make_batch
from kvserve.kernels.paged_kv import paged_kv
from kvserve.kvcache.block_pool import slot_mapping

CSRC = Path(__file__).resolve().parents[2] / "csrc"
ON_GPU = torch.cuda.is_available()
# what torch.utils.cpp_extension adds to every .cu it builds: no implicit half / bf16 operators
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernel_files_compile_standalone(arch, tmp_path):
    """Every .cu under csrc/ builds with `nvcc -c` alone: no torch headers in kernel files."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    gencode = f"arch=compute_{arch[3:]},code={arch}"
    for cu in sorted(CSRC.rglob("*.cu")):
        proc = subprocess.run(
            [nvcc, "-c", "-std=c++17", "-O3", "--use_fast_math", *TORCH_NVCC_FLAGS, f"-I{CSRC}", "-gencode", gencode,
             str(cu), "-o", str(tmp_path / "k.o")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, f"{cu.name} for {arch}:\n{proc.stderr[-3000:]}"


def test_unavailable_without_gpu():
    from kvserve.attention.cuda_backend import CudaBackend
    from kvserve.attention.registry import create_backend
    from kvserve.errors import ConfigError

    ok, reason = CudaBackend.is_available(torch.device("cpu"))
    assert not ok and "CUDA" in reason
    with pytest.raises(ConfigError, match="not available"):
        create_backend("cuda", torch.device("cpu"))


def test_plan_splits():
    from kvserve.kernels.cuda_ext import KV_TILE, plan_splits

    for ctas_per_sm in (2, 8):
        for num_ctas, max_seq_len in [(1, 1), (8, 2048), (64, 8192), (10_000, 100), (3, 65), (512, 8192)]:
            num_splits, tokens_per_split = plan_splits(num_ctas, max_seq_len, 132, ctas_per_sm)
            assert tokens_per_split % KV_TILE == 0 and num_splits >= 1
            assert (num_splits - 1) * tokens_per_split < max_seq_len <= num_splits * tokens_per_split
    # batch 64 x 8 KV heads of one-warp decode CTAs at 8k: 3 splits reach 8 CTAs per SM, 2 per SM need none
    assert plan_splits(512, 8192, 132, ctas_per_sm=8)[0] == 3
    assert plan_splits(512, 8192, 132, ctas_per_sm=2)[0] == 1


SHAPES = {
    "prefill": [(70, 70), (129, 129)],
    "chunked_prefill": [(9, 70), (100, 700)],
    "decode": [(1, 1), (1, 77), (1, 3000)],
    "mixed": [(1, 50), (20, 20), (7, 60), (1, 1000)],
}


def _gpu_batch(lens, h, h_kv, d, bs, dtype, layout="mixed"):
    """(query on the GPU, kv and meta moved to the GPU, reference output on the CPU)."""
    query, kv, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout)
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)
    kv.k_cache, kv.v_cache = kv.k_cache.cuda(), kv.v_cache.cuda()
    meta.block_tables, meta.query_start_loc = meta.block_tables.cuda(), meta.query_start_loc.cuda()
    meta.seq_lens = meta.seq_lens.cuda()
    return query.cuda(), kv, meta, ref


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (16, 2)])
@pytest.mark.parametrize("bs", [16, 32])
def test_parity_gpu(kind, dtype, d, h, h_kv, bs):
    from kvserve.attention.cuda_backend import CudaBackend

    query, kv, meta, ref = _gpu_batch(SHAPES[kind], h, h_kv, d, bs, dtype)
    out = CudaBackend().forward(query, kv, meta, d**-0.5)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
def test_runs_on_current_stream_and_rejects_bad_args():
    from kvserve.kernels import cuda_ext

    query, kv, meta, ref = _gpu_batch([(5, 40)], 4, 2, 64, 16, torch.float16, "shuffled")
    args = (query, kv.k_cache, kv.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = cuda_ext.paged_attention(*args, max_query_len=5, max_seq_len=40, scale=0.125)
    stream.synchronize()
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="dtypes differ"):
        cuda_ext.paged_attention(query.bfloat16(), *args[1:], max_query_len=5, max_seq_len=40, scale=0.125)
    with pytest.raises(ValueError, match="float32"):
        cuda_ext.paged_attention(query.float(), *args[1:], max_query_len=5, max_seq_len=40, scale=0.125)


# ---------------------------------------------------------------------------------------------------
# 8-bit pools (fp8_e4m3, int8 KIVI) read in place


def quantized_batch(codec, lens, h, h_kv, d, bs, dtype, layout="mixed", seed=0):
    """(query, QuantizedLayerKV, meta) on the CPU. Every slot of the pool first holds garbage codes
    (then the pool forgets its blocks, as after freeing them); each sequence's positions are then
    written in order, so a sequence whose length is not a multiple of bs ends in an open int8 block
    whose K lives in `open_k` while its K codes still hold garbage."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    query, dense, meta = make_batch(lens, h, h_kv, d, bs, dtype, layout, seed)
    kv = create_layer_kv(codec, dense.num_blocks, bs, h_kv, d, dtype)
    flat = (-1, h_kv, d)
    gen = torch.Generator().manual_seed(seed + 1)
    garbage = torch.randn(2, dense.num_blocks * bs, h_kv, d, generator=gen) * 100
    kv.write(torch.arange(dense.num_blocks * bs), garbage[0], garbage[1])
    for block in range(dense.num_blocks):
        kv.on_block_freed(block)
    for i, (_, seq_len) in enumerate(lens):
        slots = slot_mapping(meta.block_tables[i], torch.arange(seq_len, device=meta.block_tables.device), bs)
        kv.write(slots, dense.k_cache.view(flat)[slots], dense.v_cache.view(flat)[slots])
    return query, kv, meta


def test_quantized_batch_has_open_blocks():
    query, kv, meta = quantized_batch("int8", [(1, 77), (1, 64), (3, 20)], 4, 2, 64, 16, torch.float16)
    assert (kv.open_k.slot_of_block >= 0).sum() == 2  # the last blocks of the 77- and 20-token sequences
    assert kv.open_k.pool.shape[1:] == (16, 2, 64) and kv.open_k.pool.dtype == torch.float16


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_paged_kv_reads_8bit_pools_in_place(codec):
    from kvserve.kernels.paged_kv import PagedKV, paged_kv

    _, kv, _ = quantized_batch(codec, [(1, 40)], 4, 2, 64, 16, torch.bfloat16)
    pool = paged_kv(kv, torch.bfloat16)
    assert isinstance(pool, PagedKV) and pool.kv_format == codec
    assert pool.k_cache is kv.k_blocks.fields["codes"] and pool.v_cache is kv.v_blocks.fields["codes"]
    assert pool.k_scale is kv.k_blocks.fields["scale"] and pool.v_scale is kv.v_blocks.fields["scale"]
    if codec == "int8":
        assert pool.k_zero is kv.k_blocks.fields["zero"] and pool.v_zero is kv.v_blocks.fields["zero"]
        assert pool.k_open is kv.open_k.pool and pool.k_open_slot is kv.open_k.slot_of_block
        assert paged_kv(kv, torch.float16) is None  # open K shadows in another dtype: dense copy
    else:
        assert pool.k_zero is None and pool.k_open is None
        assert paged_kv(kv, torch.float16) is not None  # fp8 holds no compute-dtype tensor


@pytest.mark.parametrize("codec", ["int4", "turbo4", "nvfp4"])
def test_paged_kv_is_none_for_other_codecs(codec):
    from kvserve.kernels.paged_kv import paged_kv
    from kvserve.kvcache.quantized_storage import create_layer_kv

    assert paged_kv(create_layer_kv(codec, 4, 16, 2, 64, torch.float16), torch.float16) is None


def test_paged_kv_dense():
    from kvserve.kernels.paged_kv import paged_kv

    _, kv, _ = make_batch([(1, 20)], 4, 2, 64, 16, torch.float16)
    pool = paged_kv(kv, torch.float16)
    assert pool.kv_format == "dense" and pool.k_cache is kv.k_cache and pool.k_scale is None


def _call(query, pool, meta, **override):
    from kvserve.kernels import cuda_ext

    ops = {"kv_format": pool.kv_format, **pool.extras(), **override}
    k = ops.pop("k_cache", pool.k_cache)
    v = ops.pop("v_cache", pool.v_cache)
    return cuda_ext.paged_attention(
        query, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=0.125, **ops,
    )  # fmt: skip


def _broken(how, t, pool):
    """A broken stand-in for operand `t` of `pool`."""
    if how == "missing":
        return None
    if how in ("half", "float", "long"):
        return getattr(t, how)()
    if how == "other_field":  # an operand the format does not read
        return pool.k_scale
    if how == "drop_first":
        return t[1:]
    if how == "per_channel":  # V scale per channel instead of per group of 64
        return torch.zeros(*pool.v_cache.shape, dtype=torch.float16)
    if how == "column_major":  # right shape, other strides than its partner
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if how == "block_size_8":
        return torch.zeros(4, 8, *pool.k_cache.shape[2:], dtype=t.dtype)
    if how == "misaligned":  # data pointer one byte off 16-byte alignment
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    raise ValueError(how)


BAD_ARGS = [
    ("fp8_e4m3", "kv_format", "fp4", "kv_format must be one of"),
    ("fp8_e4m3", "kv_format", "dense", "dtypes differ"),  # uint8 caches read as values
    ("fp8_e4m3", "v_scale", "missing", "v_scale is required"),
    ("fp8_e4m3", "k_scale", "half", "k_scale must be float32"),
    ("fp8_e4m3", "k_zero", "other_field", "k_zero given, but kv_format 'fp8_e4m3' does not use them"),
    ("fp8_e4m3", "k_scale", "drop_first", r"k_scale must be \(\d+, 16, 2\)"),
    ("fp8_e4m3", "k_cache", "misaligned", "k_cache must be 16-byte aligned"),
    ("int8", "k_zero", "missing", "k_zero is required"),
    ("int8", "k_open", "missing", "k_open is required"),
    ("int8", "k_scale", "float", "k_scale must be torch.float16"),
    ("int8", "v_scale", "per_channel", r"v_scale must be \(\d+, 16, 2, 1\)"),
    ("int8", "k_zero", "column_major", "k_scale and k_zero strides differ"),
    ("int8", "k_open", "float", "k_open .*must have the query dtype"),
    ("int8", "k_open", "block_size_8", "k_open must be"),
    ("int8", "k_open_slot", "long", "k_open_slot must be torch.int32"),
    ("int8", "k_open_slot", "drop_first", r"k_open_slot must be \(\d+,\)"),
    ("int8", "k_cache", "half", "dtypes differ"),
    ("int8", "v_cache", "misaligned", "v_cache must be 16-byte aligned"),
]


@pytest.mark.parametrize("codec,name,how,match", BAD_ARGS)
def test_launcher_rejects_bad_8bit_args_on_cpu(codec, name, how, match):
    """Argument checks run before the device check, so they are testable on the CPU."""
    from kvserve.kernels.paged_kv import paged_kv

    query, kv, meta = quantized_batch(codec, [(1, 40), (1, 9)], 4, 2, 64, 16, torch.float16)
    pool = paged_kv(kv, torch.float16)
    if name == "kv_format":
        value = how
    else:
        current = getattr(pool, name)
        value = _broken(how, current, pool)
    with pytest.raises(ValueError, match=match):
        _call(query, pool, meta, **{name: value})


@pytest.mark.parametrize("codec", ["dense", "fp8_e4m3", "int8"])
def test_launcher_accepts_good_args_on_cpu(codec):
    """Every check passes; the launcher then stops at the device (CPU tensors)."""
    from kvserve.kernels.paged_kv import paged_kv

    if codec == "dense":
        query, kv, meta = make_batch([(1, 40), (3, 9)], 6, 2, 128, 32, torch.bfloat16)
    else:
        query, kv, meta = quantized_batch(codec, [(1, 40), (3, 9)], 6, 2, 128, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _call(query, paged_kv(kv, torch.bfloat16), meta)


def emulated_kernel(meta_of_call):
    """A CPU stand-in for cuda_ext.paged_attention with the kernel's reading of each KV format
    (attention/paged_attention.h, KvFormat), for checking what CudaBackend passes it."""
    import dataclasses

    from kvserve.kvcache.kv_storage import DenseLayerKV

    def fake(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *, max_query_len,
             max_seq_len, scale, kv_format="dense", k_scale=None, k_zero=None, v_scale=None, v_zero=None,
             k_open=None, k_open_slot=None):  # fmt: skip
        if kv_format == "dense":
            k, v = k_cache.float(), v_cache.float()
        elif kv_format == "fp8_e4m3":
            k = k_cache.view(torch.float8_e4m3fn).float() * k_scale[..., None]
            v = v_cache.view(torch.float8_e4m3fn).float() * v_scale[..., None]
        else:
            k = k_cache.float() * k_scale.float()[:, None] + k_zero.float()[:, None]
            is_open = k_open_slot >= 0
            k[is_open] = k_open[k_open_slot[is_open].long()].float()
            groups = v_scale.shape[-1]
            v = (
                v_cache.float().unflatten(-1, (groups, -1)) * v_scale.float()[..., None]
                + v_zero.float()[..., None]
            )
            v = v.flatten(-2)
        dense = DenseLayerKV(*k.shape, dtype=query.dtype)
        dense.k_cache, dense.v_cache = k.to(query.dtype), v.to(query.dtype)
        meta = dataclasses.replace(meta_of_call, block_tables=block_tables)
        fake.calls.append(kv_format)
        return ReferenceBackend().forward(query, dense, meta, scale)

    fake.calls = []
    return fake


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "turbo4", "int4", "mxfp4", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backend_routes_pools_on_cpu(codec, dtype, monkeypatch):
    """CudaBackend hands fp8 / int8 pools to the kernel in place and any other codec (mxfp4, which
    paged_kv describes for Triton, included) as a dense copy of the referenced blocks; an emulation
    of the kernel's format reading matches the reference."""
    from kvserve.attention.cuda_backend import CudaBackend
    from kvserve.kernels import cuda_ext

    lens = [(1, 77), (1, 9), (4, 40)]
    if codec == "fp16":
        query, kv, meta = make_batch(lens, 6, 2, 64, 16, dtype)
    else:
        query, kv, meta = quantized_batch(codec, lens, 6, 2, 64, 16, dtype)
    fake = emulated_kernel(meta)
    monkeypatch.setattr(cuda_ext, "paged_attention", fake)
    out = CudaBackend().forward(query, kv, meta, 0.125)
    assert fake.calls == [codec if codec in ("fp8_e4m3", "int8") else "dense"]
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


def test_backend_copies_int8_pool_for_another_query_dtype(monkeypatch):
    """Open K shadows in fp16, queries in bf16: the kernel cannot read them, so a dense copy."""
    from kvserve.attention.cuda_backend import CudaBackend
    from kvserve.kernels import cuda_ext

    query, kv, meta = quantized_batch("int8", [(1, 77), (2, 30)], 4, 2, 64, 16, torch.float16)
    query = query.bfloat16()
    fake = emulated_kernel(meta)
    monkeypatch.setattr(cuda_ext, "paged_attention", fake)
    out = CudaBackend().forward(query, kv, meta, 0.125)
    assert fake.calls == ["dense"] and out.dtype == torch.bfloat16
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=0)


# ---------------------------------------------------------------------------------------------------
# The kernel's K/V tile loads (csrc/attention/kv_tile.cuh), built for the CPU and run thread by thread

TILE_HARNESS = r"""
#include "attention/kv_tile.cuh"
using namespace kvserve;

template <typename T, int D, KvFormat F, bool K>
void run(const PagedAttentionParams& p, const int32_t* table, int kv_head, int start, int end, int threads,
         void* smem, float* scale_smem) {
  const KvSource src = make_kv_source<T, F, K>(p, kv_head);
  for (int tid = 0; tid < threads; ++tid) {
    load_kv_tile<T, D, F, K>(static_cast<T*>(smem), scale_smem, src, table, p.block_size, start, end, tid, threads);
  }
}

template <typename T, int D, KvFormat F>
void run_side(bool is_k, const PagedAttentionParams& p, const int32_t* table, int kv_head, int start, int end,
              int threads, void* smem, float* scale_smem) {
  if (is_k) run<T, D, F, true>(p, table, kv_head, start, end, threads, smem, scale_smem);
  else run<T, D, F, false>(p, table, kv_head, start, end, threads, smem, scale_smem);
}

template <typename T, int D>
void run_format(int fmt, bool is_k, const PagedAttentionParams& p, const int32_t* table, int kv_head, int start,
                int end, int threads, void* smem, float* scale_smem) {
  if (fmt == 0) run_side<T, D, KvFormat::kDense>(is_k, p, table, kv_head, start, end, threads, smem, scale_smem);
  if (fmt == 1) run_side<T, D, KvFormat::kFp8E4m3>(is_k, p, table, kv_head, start, end, threads, smem, scale_smem);
  if (fmt == 2) run_side<T, D, KvFormat::kInt8Kivi>(is_k, p, table, kv_head, start, end, threads, smem, scale_smem);
}

// One side of the pool (K or V), as the binding fills PagedAttentionParams for it: strides[0..2] of
// the cache, [3..5] of scale / zero, [6..8] of k_open (block, slot, head), all in elements.
extern "C" int load_tile(int dtype, int fmt, int is_k, int head_dim, int threads, const void* cache,
                         const void* scale, const void* zero, const void* open, const int32_t* open_slot,
                         const int64_t* strides, const int32_t* table, int block_size, int kv_head,
                         int start, int end, void* smem, float* scale_smem) {
  PagedAttentionParams p{};
  p.k_cache = p.v_cache = cache;
  p.k_stride_block = p.v_stride_block = strides[0];
  p.k_stride_slot = p.v_stride_slot = strides[1];
  p.k_stride_head = p.v_stride_head = strides[2];
  p.k_scale = p.v_scale = scale;
  p.k_zero = p.v_zero = zero;
  p.ks_stride_block = p.vs_stride_block = strides[3];
  p.ks_stride_slot = p.vs_stride_slot = strides[4];
  p.ks_stride_head = p.vs_stride_head = strides[5];
  p.k_open = open;
  p.k_open_slot = open_slot;
  p.ko_stride_block = strides[6];
  p.ko_stride_slot = strides[7];
  p.ko_stride_head = strides[8];
  p.block_size = block_size;
  p.head_dim = head_dim;
  const bool k = is_k != 0;
  if (dtype == 0 && head_dim == 64) run_format<__half, 64>(fmt, k, p, table, kv_head, start, end, threads, smem, scale_smem);
  else if (dtype == 0 && head_dim == 128) run_format<__half, 128>(fmt, k, p, table, kv_head, start, end, threads, smem, scale_smem);
  else if (dtype == 1 && head_dim == 64) run_format<__nv_bfloat16, 64>(fmt, k, p, table, kv_head, start, end, threads, smem, scale_smem);
  else if (dtype == 1 && head_dim == 128) run_format<__nv_bfloat16, 128>(fmt, k, p, table, kv_head, start, end, threads, smem, scale_smem);
  else return 1;
  return 0;
}

extern "C" void decode_e4m3(const uint8_t* codes, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = e4m3_to_float(codes[i]);
}
"""


@pytest.fixture(scope="module")
def tile_lib(tmp_path_factory):
    """kv_tile.cuh compiled into a host shared library (nvcc, no GPU needed), loaded with ctypes."""
    import ctypes

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    out = tmp_path_factory.mktemp("kv_tile")
    (out / "harness.cu").write_text(TILE_HARNESS)
    proc = subprocess.run(
        [nvcc, "-shared", "-std=c++17", "-O2", *TORCH_NVCC_FLAGS, "-Xcompiler", "-fPIC,-fno-strict-aliasing",
         "-gencode", "arch=compute_80,code=sm_80", f"-I{CSRC}", str(out / "harness.cu"), "-o", str(out / "harness.so")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(out / "harness.so"))
    lib.load_tile.restype = ctypes.c_int
    int_, ptr = ctypes.c_int, ctypes.c_void_p
    lib.load_tile.argtypes = [int_] * 5 + [ptr] * 7 + [int_] * 4 + [ptr] * 2  # as in TILE_HARNESS
    lib.decode_e4m3.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def _ptr(t):
    return None if t is None else t.data_ptr()


def _load_tile(lib, pool, is_k, dtype, table, kv_head, start, end, threads):
    """(smem [kKvTile, D + 8] in dtype, scale_smem [kKvTile]) after every thread's share of the load."""
    from kvserve.kernels.cuda_ext import KV_FORMATS, KV_TILE

    cache = pool.k_cache if is_k else pool.v_cache
    head_dim = cache.shape[3]
    scale = pool.k_scale if is_k else pool.v_scale
    zero = pool.k_zero if is_k else pool.v_zero
    strides = list(cache.stride()[:3])
    if scale is None:
        strides += [0, 0, 0]
    elif pool.kv_format == "int8" and is_k:  # [num_blocks, H_kv, D]: one row per block (bindings.cpp)
        strides += [scale.stride(0), 0, scale.stride(1)]
    else:
        strides += list(scale.stride()[:3])
    open_k = pool.k_open if is_k else None
    strides += list(open_k.stride()[:3]) if open_k is not None else [0, 0, 0]
    strides_t = torch.tensor(strides, dtype=torch.int64)
    smem = torch.full((KV_TILE, head_dim + 8), float("nan"), dtype=dtype)
    scale_smem = torch.full((KV_TILE,), float("nan"), dtype=torch.float32)
    rc = lib.load_tile(
        0 if dtype == torch.float16 else 1, KV_FORMATS[pool.kv_format], int(is_k), head_dim, threads,
        _ptr(cache), _ptr(scale), _ptr(zero), _ptr(open_k), _ptr(pool.k_open_slot if is_k else None),
        _ptr(strides_t), _ptr(table), cache.shape[1], kv_head, start, end, _ptr(smem), _ptr(scale_smem),
    )  # fmt: skip
    assert rc == 0
    return smem, scale_smem


def test_e4m3_decode_is_exact(tile_lib):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN codes
    out = torch.empty(codes.numel(), dtype=torch.float32)
    tile_lib.decode_e4m3(codes.data_ptr(), out.data_ptr(), codes.numel())
    assert torch.equal(out, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("codec", ["dense", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32), (128, 16)])
def test_tile_loads_match_decoders(tile_lib, codec, dtype, d, bs):
    """Every tile of every sequence, K and V, every kv head, with 32 and 128 threads: the smem tile
    the kernel would compute on equals the codec's decode (kvserve/quant) rounded to the query
    dtype, rows past the tile end are zero; fp8 K holds exact codes and its scales in scale_smem."""
    from kvserve.kernels.cuda_ext import KV_TILE
    from kvserve.kernels.paged_kv import paged_kv

    lens = [(1, 77), (1, 64), (1, 150), (1, 5)]
    if codec == "dense":
        _, kv, meta = make_batch(lens, 4, 2, d, bs, dtype)
    else:
        _, kv, meta = quantized_batch(codec, lens, 4, 2, d, bs, dtype)
    pool = paged_kv(kv, dtype)
    k_all, v_all = kv.gather(torch.arange(kv.num_blocks))  # [num_blocks, bs, H_kv, D] in dtype
    if codec == "fp8_e4m3":  # the kernel keeps K codes exact and scales the scores instead
        k_all = kv.k_blocks.fields["codes"].view(torch.float8_e4m3fn).to(dtype)
    checked = 0
    for i, (_, seq_len) in enumerate(lens):
        table = meta.block_tables[i].contiguous()
        pos = torch.arange(seq_len)
        blocks, slots = table.long()[pos // bs], pos % bs
        for start in range(0, seq_len, KV_TILE):
            full_end = min(seq_len, start + KV_TILE)
            for end in sorted({full_end, max(start + 1, full_end - 3)}):  # also a tile cut short
                rows = end - start
                for kv_head, (is_k, ref), threads in itertools.product(
                    range(2), ((True, k_all), (False, v_all)), (32, 128)
                ):
                    expected = ref[blocks, slots, kv_head][start:end]  # [rows, D]
                    smem, scale_smem = _load_tile(
                        tile_lib, pool, is_k, dtype, table, kv_head, start, end, threads
                    )
                    assert torch.isnan(smem[:, d:].float()).all(), "the row padding must stay untouched"
                    got = smem[:, :d].float()
                    torch.testing.assert_close(got[:rows], expected.float(), atol=1e-6, rtol=2**-8)
                    assert not got[rows:].any(), "rows past the tile end must be zero"
                    if codec == "fp8_e4m3" and is_k:
                        scales = kv.k_blocks.fields["scale"][blocks, slots, kv_head][start:end]
                        assert torch.equal(scale_smem[:rows], scales)
                        assert not scale_smem[rows:].any()
                    checked += 1
    assert checked == 8 * 2 * (2 + 1 + 3 + 1)  # 8 per (tile, end), two ends per tile


# ---------------------------------------------------------------------------------------------------
# GPU parity of 8-bit pools read in place


def _to_gpu(kv, meta):
    """Moves a CPU-built QuantizedLayerKV (fields, open-K shadows) and the metadata to the GPU."""
    for blocks in (kv.k_blocks, kv.v_blocks):
        blocks.fields = {name: t.cuda() for name, t in blocks.fields.items()}
    kv.open_k.pool, kv.open_k.slot_of_block = kv.open_k.pool.cuda(), kv.open_k.slot_of_block.cuda()
    meta.block_tables, meta.query_start_loc = meta.block_tables.cuda(), meta.query_start_loc.cuda()
    meta.seq_lens = meta.seq_lens.cuda()


QUANT_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _check_quantized_gpu(codec, lens, h, h_kv, d, bs, dtype, layout="mixed"):
    from kvserve.attention.cuda_backend import CudaBackend

    query, kv, meta = quantized_batch(codec, lens, h, h_kv, d, bs, dtype, layout)
    ref = ReferenceBackend().forward(query, kv, meta, d**-0.5)  # reads the same dequantized values
    _to_gpu(kv, meta)
    assert paged_kv(kv, dtype) is not None  # read in place, no dense copy
    out = CudaBackend().forward(query.cuda(), kv, meta, d**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=QUANT_TOL[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2), (16, 2)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("bs", [16, 32])
def test_quantized_decode_parity_gpu(codec, dtype, d, h, h_kv, bs):
    """Decode over fp8 / int8 pools; int8 sequences whose length is not a multiple of bs end in an
    open block (K read from open_k, its codes hold garbage); 3000 tokens take the split-KV path."""
    _check_quantized_gpu(codec, [(1, 1), (1, 77), (1, 64), (1, 3000)], h, h_kv, d, bs, dtype)


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("kind", ["prefill", "chunked_prefill", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_prefill_parity_gpu(codec, kind, dtype):
    """The same tile loads serve the 4-warp prefill configuration."""
    _check_quantized_gpu(codec, SHAPES[kind], 6, 2, 128, 16, dtype)
    _check_quantized_gpu(codec, SHAPES[kind], 8, 8, 64, 32, dtype, layout="shuffled")


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
@pytest.mark.parametrize("codec", ["turbo4", "int4"])
def test_other_codecs_take_a_dense_copy_gpu(codec):
    from kvserve.attention.cuda_backend import CudaBackend

    query, kv, meta = quantized_batch(codec, [(1, 77), (5, 40)], 6, 2, 64, 16, torch.float16)
    ref = ReferenceBackend().forward(query, kv, meta, 0.125)
    _to_gpu(kv, meta)
    out = CudaBackend().forward(query.cuda(), kv, meta, 0.125)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=4e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.cuda_ext
@needs_gpu
def test_binding_rejects_bad_8bit_args_gpu():
    """The TORCH_CHECKs in bindings.cpp, reached by calling the extension directly."""
    from kvserve.kernels import cuda_ext

    query, kv, meta = quantized_batch("int8", [(1, 40)], 4, 2, 64, 16, torch.float16)
    _to_gpu(kv, meta)
    pool = paged_kv(kv, torch.float16)
    args = [query.cuda(), pool.k_cache, pool.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            1, 0.125, 1, 64, True, 2, pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero, pool.k_open,
            pool.k_open_slot]  # fmt: skip
    ext = cuda_ext.load()
    ext.paged_attention(*args)  # the good call runs
    bad = list(args)
    bad[13] = None  # k_zero
    with pytest.raises(RuntimeError, match="k_zero is required"):
        ext.paged_attention(*bad)
    bad = list(args)
    bad[16] = pool.k_open.float()
    with pytest.raises(RuntimeError, match="k_open must have the query dtype"):
        ext.paged_attention(*bad)
    bad = list(args)
    bad[11] = 3
    with pytest.raises(RuntimeError, match="kv_format must be"):
        ext.paged_attention(*bad)
