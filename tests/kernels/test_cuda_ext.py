"""CUDA extension: nvcc compile check of every kernel file (no GPU needed), availability on CPU,
and parity against the reference backend on a GPU (marked gpu + cuda_ext)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.attention.reference import ReferenceBackend
from kvserve.kernels.paged_batch import make_batch

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

    for num_ctas, max_seq_len in [(1, 1), (8, 2048), (64, 8192), (10_000, 100), (3, 65)]:
        num_splits, tokens_per_split = plan_splits(num_ctas, max_seq_len, num_sms=132)
        assert tokens_per_split % KV_TILE == 0 and num_splits >= 1
        assert (num_splits - 1) * tokens_per_split < max_seq_len <= num_splits * tokens_per_split


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
