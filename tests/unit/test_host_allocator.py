"""keep_freed_memory (kernels/host_allocator.py): glibc serves a step's megabyte temporaries from its
heap and keeps them when freed, so they are not faulted in again. Each case runs in a fresh interpreter:
mallopt settings last for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, resource, threading, torch
from kvserve.kernels.host_allocator import keep_freed_memory
print(sorted(keep_freed_memory().items()))

class MallInfo2(ctypes.Structure):  # glibc 2.33+
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = MallInfo2, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)  # above glibc's initial mmap threshold (128 KiB), below 32 MiB
print(libc.mallinfo2().hblks - before)  # 1: a mapping of its own; 0: from the heap
libc.free(block)

def churn():  # a layer's temporaries a round, with a 1,800-token Qwen prefill's sizes (MiB)
    for _ in range(8):
        x, q = (torch.empty(n << 20, dtype=torch.uint8).fill_(1) for n in (3, 4))
        a = torch.empty(3 << 20, dtype=torch.uint8).fill_(1)
        del q
        g, u, h = (torch.empty(17 << 20, dtype=torch.uint8).fill_(1) for _ in range(3))
        del g, u
        y = torch.empty(3 << 20, dtype=torch.uint8).fill_(1)
        del h, a, x, y

def faults_of_second_churn():
    churn()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, flush=True)

faults_of_second_churn()  # on the main thread
worker = threading.Thread(target=faults_of_second_churn)  # as the server's engine thread
worker.start()
worker.join()
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def run(tuning: str) -> tuple[str, int, int, int]:
    env = {**os.environ, "KVSERVE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    applied, mapped, faults, worker_faults = out.stdout.split("\n")[:4]
    return applied, int(mapped), int(faults), int(worker_faults)


def test_freed_memory_is_reused_without_page_faults():
    applied, mapped, faults, _ = run("1")
    assert applied == "[('arena_max', 1), ('mmap_threshold', 33554432), ('trim_threshold', 536870912)]"
    assert mapped == 0  # a 24 MiB block comes from the heap
    assert faults < 500, faults  # 8 rounds of 61 MiB (15,616 pages) would fault in if freed memory went back


def test_a_worker_thread_reuses_freed_memory_too():
    """A thread's own glibc arena unmaps each of its heaps once wholly free, whatever the trim threshold
    (about 100k faults a second churn before the one-arena cap): the cap sends it to the tuned heap."""
    _, _, _, worker_faults = run("1")
    assert worker_faults < 500, worker_faults


def test_off_switch_keeps_glibc_defaults():
    applied, mapped, _, _ = run("0")
    assert applied == "[]"
    assert mapped == 1  # glibc's default maps it on its own (what the tuning changes)
