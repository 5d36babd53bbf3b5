"""Row max / sum for the kernels, working whichever way triton was imported.

tl.max and tl.sum are @jit functions of triton's standard library, decorated at `import triton` in
the mode TRITON_INTERPRET had then. `import kvserve` imports triton through torch, so in a test
session they can be compiled-mode functions while these kernels are interpreted, which fails.
Then (and only then) the reductions go through tl.reduce with local combine functions, decorated
with the kernels in the same mode; the interpreter runs those element by element (slow), so the
standard ones are used whenever they work. Same reason the kernels use tl.full, not tl.zeros.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
STDLIB_USABLE = not _INTERPRETING or type(tl.sum).__name__ == "InterpretedFunction"


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add2(a, b):
    return a + b


if STDLIB_USABLE:

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.max(x, axis)

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis)

else:

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _max2)

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _add2)
