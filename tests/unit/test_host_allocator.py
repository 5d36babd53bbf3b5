"""keep_freed_memory: freed tensors' pages are reused, not faulted in again (kernels/host_allocator.py).
Each case runs in a fresh interpreter: mallopt settings last for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FAULTS = """
import resource, torch
from kvserve.kernels.host_allocator import keep_freed_memory
print(sorted(keep_freed_memory().items()))
def churn():  # two 20 MiB temporaries a round, as a layer's SiLU output and product
    for _ in range(5):
        a = torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
        b = torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
        del a, b
churn()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def run(tuning: str) -> tuple[str, int]:
    env = {**os.environ, "KVSERVE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split("\n")[:2]
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    applied, faults = run("1")
    assert applied == "[('mmap_threshold', 33554432), ('trim_threshold', 536870912)]"
    assert faults < 500, faults  # 5 rounds x 2 x 5,120 pages would fault in without it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_off_switch_keeps_glibc_defaults():
    applied, faults = run("0")
    assert applied == "[]"
    assert faults > 10_000, faults  # the same churn faults its pages in again: what the tuning removes
