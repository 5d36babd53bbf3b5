"""What this CPU computes fast, read at run time (the CPU model changes between machines; never assume).

`cpu_flags()` reads the kernel's view of the CPU (/proc/cpuinfo on Linux). AMX (amx_bf16) and AVX-512
BF16 (avx512_bf16) execute bf16 dot products natively; without either, bf16 compute is emulated through
fp32 and slower than fp32 itself.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def torch_capability() -> str:
    """'AVX512', 'AVX2' or another of torch's capabilities (what ATen dispatches to here)."""
    return str(torch.backends.cpu.get_cpu_capability())


def has_avx512_bf16() -> bool:
    return torch_capability() == "AVX512" and "avx512_bf16" in cpu_flags()


def has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags() and "amx_tile" in cpu_flags()


def bf16_units() -> str:
    """The CPU's native bf16 units, by name ('' when it has none)."""
    return " + ".join(n for n, ok in (("AMX", has_amx_bf16()), ("AVX-512 BF16", has_avx512_bf16())) if ok)
