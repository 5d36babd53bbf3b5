"""Shared fixtures. Engines are module-scoped: building one takes seconds."""

from __future__ import annotations

import os
import shutil

# Triton kernels run in the interpreter where there is no GPU. This must be set before anything
# imports triton (torch and transformers may).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `--dtype auto` resolves by the CPU (bfloat16 where it has native bf16 units): pin it, so that the suite
# tests the same thing on every machine; tests of bf16 ask for it by name.
os.environ.setdefault("KVSERVE_AUTO_CPU_DTYPE", "float32")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: tests share 2 cores with server subprocesses, and oversubscribed OpenMP
# threads make small ops 30x slower. (Benchmarks under scripts/ use the machine's default.)
torch.set_num_threads(1)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU attention extension once, up front, so that no server subprocess started by a
    test spends its start-up timeout compiling it (where it cannot be built, cpu_paged uses torch ops)."""
    from kvserve.kernels import cpu_ext

    cpu_ext.load_or_none()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available()
    ext = False
    if has_gpu:
        try:
            from kvserve.kernels import cuda_ext

            ext = bool(cuda_ext.is_available()[0])
        except Exception:
            ext = False
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "cuda_ext" in item.keywords and not ext:
            item.add_marker(pytest.mark.skip(reason="needs the compiled kvserve CUDA extension"))
