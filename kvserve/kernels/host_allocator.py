"""glibc's malloc told to keep freed memory for reuse, so that a CPU step's large temporaries do not
fault their pages in again on every layer.

Why: a forward step allocates and frees tensors of megabytes per layer (a 1,800-token Qwen2.5-0.5B
prefill: a 17 MB SiLU output, then the product, then the next layer's). glibc serves a request above
its mmap threshold with a fresh mapping and returns it at free, and it trims the top of its heap once
the free space there passes the trim threshold (by default both adapt, up to 32 MiB and 64 MiB). Every
such tensor then page-faults all of its pages in on first write: 8,961 faults for 35 MB, 13 ms where
filling memory already mapped takes 1.2 ms (this session's Intel Xeon). Measured on that prefill with
both limits raised from outside (GLIBC_TUNABLES): 2,153 -> 1,722 ms (scripts/profile_step.py).

`keep_freed_memory()` sets the mmap threshold to glibc's largest (32 MiB; larger requests are still
mapped) and the trim threshold to TRIM_BYTES, once per process. The price: up to TRIM_BYTES of freed
heap stays with the process instead of going back to the OS (what tcmalloc and jemalloc, the
allocators vLLM's CPU guide preloads, do by design). KVSERVE_MALLOC_TUNING=0 leaves glibc's defaults;
elsewhere than glibc it does nothing.

It also caps glibc at one arena (M_ARENA_MAX = 1), because the server steps the engine on a thread of
its own (engine/async_engine.py), and a thread other than the main one allocates from an arena of its
own, made of heaps of at most 64 MiB that glibc unmaps whenever one is wholly free, whatever the trim
threshold: a prefill's temporaries then fault their pages in on every layer again. Measured on
2026-12-02 (AMD EPYC, the same 1,800-token Qwen prefill in process, 4 runs each): on the main thread
1.76-1.80 s and 0-320 faults, on a worker thread 2.18-2.33 s and 204k-237k faults; with one arena the
worker thread faults 0 times and runs as fast as the main thread. The cap applies to threads that
allocate for the first time after it is set, so the server sets it at start-up (`cli.serve`), before
it starts any thread. The price: the process's threads share one arena's lock; the engine thread
allocates nearly all of the large blocks, and Python's small objects come from its own allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger("kvserve.engine")

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_BYTES = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_BYTES = 512 << 20


@functools.cache
def keep_freed_memory() -> dict[str, int]:
    """The thresholds set ({} when none: not glibc, or KVSERVE_MALLOC_TUNING=0). Idempotent."""
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0":
        return {}
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    for param, key, value in (
        (M_MMAP_THRESHOLD, "mmap_threshold", MMAP_BYTES),
        (M_TRIM_THRESHOLD, "trim_threshold", TRIM_BYTES),
        (M_ARENA_MAX, "arena_max", 1),
    ):
        if mallopt(param, value) == 1:
            applied[key] = value
    if applied:
        log.info(
            "malloc keeps freed memory for reuse: %s (KVSERVE_MALLOC_TUNING=0 to keep glibc's defaults)",
            applied,
        )
    return applied
