"""Kernel tests: on a machine without CUDA, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET is read when a @triton.jit decorator runs, so it must be set before the kernel
modules are imported (they are imported lazily, inside tests). The kernels avoid triton's own @jit
helpers (tl.max, tl.sum, tl.zeros), which are bound at `import triton`, possibly before this runs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
