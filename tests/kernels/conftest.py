"""Kernel tests: on a machine without CUDA, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET is read when a @triton.jit decorator runs, so it must be set before the kernel
modules are imported (they are imported lazily, inside tests). The kernels avoid triton's own @jit
helpers (tl.max, tl.sum, tl.zeros), which are bound at `import triton`, possibly before this runs.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def ext():
    """The built CPU extension; its absence is a failure where a compiler exists (make test builds it)."""
    from kvserve.kernels import cpu_ext  # after TRITON_INTERPRET is set

    reason = cpu_ext.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return cpu_ext.load()


@contextlib.contextmanager
def lanes_only(ext):
    """The extension's AVX-512 paths inside the block (set_amx(False)), AMX restored after."""
    before = ext.set_amx(False)
    try:
        yield
    finally:
        ext.set_amx(before)
