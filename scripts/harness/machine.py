"""What machine a benchmark ran on, for every report: the CPU by name (they change between sessions),
cores, memory, torch and the vector capability it dispatches to."""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def describe(threads: int | None = None) -> str:
    """One line: 'AMD EPYC 7B13, 2 cores, AVX512 (AVX-512 BF16), torch 2.13.0+cpu, 1 torch thread' (the
    native bf16 units in brackets: AMX, AVX-512 BF16)."""
    import torch

    m = machine()
    from kvserve.kernels.cpu_features import bf16_units

    n = torch.get_num_threads() if threads is None else threads
    units = bf16_units()
    isa = f"{m['cpu_capability']} ({units})" if units else m["cpu_capability"]
    return f"{m['cpu']}, {m['cores']} cores, {isa}, torch {m['torch']}, {n} torch thread{'s' * (n != 1)}"
