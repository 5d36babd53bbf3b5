"""Start-up picks an attention backend, device and dtype that run together, or fails saying what to do.

No GPU is needed: `torch.device("cuda")` constructs without one, and what a CUDA host would report
(triton installed, a device present, the extension built) is monkeypatched.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.cuda_backend import CudaBackend
from kvserve.attention.reference import ReferenceBackend
from kvserve.attention.registry import BACKENDS, backend_class, create_backend
from kvserve.attention.triton_backend import TritonBackend
from kvserve.engine.choose import resolve_device, resolve_dtype
from kvserve.errors import ConfigError
from kvserve.kernels.checks import check_paged_args

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def _unavailable(reason: str):
    return classmethod(lambda cls, device, **facts: (False, reason))


@pytest.fixture
def no_gpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA host where triton is not installed and the CUDA extension cannot be built."""
    monkeypatch.setattr(
        TritonBackend, "is_available", _unavailable("triton is not installed (pip install triton)")
    )
    monkeypatch.setattr(CudaBackend, "is_available", _unavailable("nvcc not found"))


@pytest.fixture
def cuda_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA host with triton and a built extension reports (nothing is launched)."""
    from kvserve.kernels import cuda_ext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ext, "unavailable_reason", lambda: "")
    monkeypatch.setattr(cuda_ext, "load", lambda: None)


def test_auto_on_cuda_without_gpu_kernels_picks_a_backend_that_runs_on_cuda(
    no_gpu_kernels: None, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING, logger="kvserve.attention"):
        backend = create_backend("auto", CUDA)
    assert type(backend).is_available(CUDA)[0], f"auto picked {backend.name}, which cannot run on cuda"
    assert backend.name == "reference"
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "slow" in warning and "pip install triton" in warning, warning


def test_cpu_paged_on_cuda_is_refused_at_start_up_with_the_fix():
    ok, reason = CpuPagedBackend.is_available(CUDA)
    assert not ok
    with pytest.raises(ConfigError, match="not available") as err:
        create_backend("cpu_paged", CUDA)
    assert "--device cpu" in err.value.message and "--attention-backend" in err.value.message
    assert err.value.param == "attention_backend"


def test_auto_on_cpu_picks_cpu_paged():
    assert create_backend("auto", CPU).name == "cpu_paged"
    assert create_backend("auto", CPU, head_dim=16, dtype=torch.float16).name == "cpu_paged"


def test_reference_backend_claims_every_device():
    for device in (CPU, CUDA, torch.device("meta")):
        assert ReferenceBackend.is_available(device, head_dim=16, dtype=torch.bfloat16) == (True, "")


def test_reference_backend_runs_off_the_cpu():
    """`meta` stands in for cuda: a CPU tensor mixed into the computation fails the same way."""
    from kvserve.attention.testing import make_batch

    query, kv, meta = make_batch([(3, 20), (1, 9)], 4, 2, 16, 16, torch.float32, "mixed")
    kv.k_cache, kv.v_cache = kv.k_cache.to("meta"), kv.v_cache.to("meta")
    meta.block_tables = meta.block_tables.to("meta")
    out = ReferenceBackend().forward(query.to("meta"), kv, meta, 0.25)
    assert out.device.type == "meta"


def _launcher_accepts_head_dim(head_dim: int) -> bool:
    k = torch.zeros(2, 16, 2, head_dim)
    args = (torch.zeros(3, 4, head_dim), k, k.clone())
    meta = (torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    try:
        check_paged_args(*args, meta[0], meta[1], torch.tensor([3], dtype=torch.int32))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("backend", [TritonBackend, CudaBackend])
def test_gpu_kernels_refuse_at_start_up_the_head_dims_their_launchers_reject(cuda_host: None, backend):
    for head_dim in (16, 32, 64, 80, 96, 128, 256):
        ok, reason = backend.is_available(CUDA, head_dim=head_dim, dtype=torch.bfloat16)
        assert ok == _launcher_accepts_head_dim(head_dim), (head_dim, reason)
        if not ok:
            assert f"head_dim {head_dim}" in reason and "--attention-backend" in reason, reason


def test_auto_on_cuda_skips_kernels_that_cannot_take_the_model(cuda_host: None):
    """tiny-random-llama (head_dim 16) on a GPU: the kernels would reject it at the first request."""
    assert create_backend("auto", CUDA, head_dim=64, dtype=torch.bfloat16).name == "triton"
    assert create_backend("auto", CUDA, head_dim=16, dtype=torch.bfloat16).name == "reference"
    with pytest.raises(ConfigError, match="head_dim 16"):
        create_backend("triton", CUDA, head_dim=16, dtype=torch.bfloat16)


def test_cuda_extension_refuses_float32_with_the_fix(cuda_host: None, monkeypatch: pytest.MonkeyPatch):
    ok, reason = CudaBackend.is_available(CUDA, head_dim=64, dtype=torch.float32)
    assert not ok and "--dtype bfloat16" in reason, reason
    monkeypatch.setattr(TritonBackend, "is_available", _unavailable("triton is not installed"))
    assert create_backend("auto", CUDA, head_dim=64, dtype=torch.float32).name == "reference"
    assert create_backend("auto", CUDA, head_dim=64, dtype=torch.float16).name == "cuda"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_names_the_fix_when_it_cannot_run_on_the_cpu(
    name: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, reason = backend_class(name).is_available(CPU, head_dim=64, dtype=torch.float32)
    if name in ("reference", "cpu_paged"):
        assert ok, reason
    else:
        assert not ok and "--attention-backend" in reason, reason


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        create_backend("flash", CPU)


def test_device_cuda_without_a_gpu_fails_at_start_up(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == CPU


def test_dtype_auto_avoids_emulated_bfloat16_on_older_gpus(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # T4
    assert resolve_dtype("auto", CUDA) == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    assert resolve_dtype("auto", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("float16", CPU) == torch.float16  # runs on CPU: test_content_reuse_dtypes.py


def test_dtype_auto_on_cpu_follows_the_hardware_and_a_timing(monkeypatch: pytest.MonkeyPatch):
    """No native bf16 units: float32 without timing anything. With them: bfloat16 only when the measured
    linear is faster. The test suite's pin (KVSERVE_AUTO_CPU_DTYPE) and --dtype override both."""
    from kvserve.engine import choose
    from kvserve.kernels import cpu_features

    monkeypatch.delenv(choose.AUTO_CPU_DTYPE_ENV, raising=False)
    timed: list[torch.dtype] = []
    speed = {torch.float32: 2.0, torch.bfloat16: 1.0}
    monkeypatch.setattr(choose, "_linear_seconds", lambda dtype: timed.append(dtype) or speed[dtype])
    monkeypatch.setattr(cpu_features, "bf16_units", lambda: "")
    choose.choose_cpu_dtype.cache_clear()
    assert resolve_dtype("auto", CPU) == torch.float32 and timed == []
    assert "no native bf16" in choose.choose_cpu_dtype()[1]

    monkeypatch.setattr(cpu_features, "bf16_units", lambda: "AVX-512 BF16")
    choose.choose_cpu_dtype.cache_clear()
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    # the linear's path where the extension loads: "(AMX tiles)" or "(AVX512_BF16 lanes)"
    assert re.fullmatch(
        r"AVX-512 BF16; bf16 linear( \(.+\))? measured 2.0x faster than fp32", choose.choose_cpu_dtype()[1]
    )
    assert timed == [torch.float32, torch.bfloat16] * choose.TIMING_ROUNDS  # alternating rounds
    # load on the machine during one round (here the first bf16 timing, 10x slower) does not decide
    rounds = iter([2.0, 10.0] + [2.0, 1.0] * (choose.TIMING_ROUNDS - 1))
    monkeypatch.setattr(choose, "_linear_seconds", lambda dtype: next(rounds))
    choose.choose_cpu_dtype.cache_clear()
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setattr(choose, "_linear_seconds", lambda dtype: timed.append(dtype) or speed[dtype])
    speed[torch.bfloat16] = 3.0
    choose.choose_cpu_dtype.cache_clear()
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16  # --dtype overrides
    choose.choose_cpu_dtype.cache_clear()

    monkeypatch.setenv(choose.AUTO_CPU_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setenv(choose.AUTO_CPU_DTYPE_ENV, "float64")
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        resolve_dtype("auto", CPU)


def test_the_cpu_timing_runs_the_kernel_the_model_would_use():
    from kvserve.engine import choose

    for dtype in (torch.float32, torch.bfloat16):
        assert 0 < choose._linear_seconds(dtype) < 5
