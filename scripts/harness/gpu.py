"""A GPU's two ceilings, measured (a large device-to-device copy counting bytes read plus written; a large
bf16 matrix product on random data), and its datasheet HBM bandwidth: what the GPU run's figures are read
against (scripts/gpu/env_report.py, scripts/bench_kernels.py --device cuda)."""

from __future__ import annotations

import torch

# vendor datasheet figures (leads, not readings): HBM bandwidth in TB/s by device-name fragment
DATASHEET_TBPS = {"H200": 4.8, "H100": 3.35}


def datasheet_tbps(name: str) -> float | None:
    return next((tbps for key, tbps in DATASHEET_TBPS.items() if key in name), None)


def median_ms(fn, reps: int = 20) -> float:
    """Median of `reps` CUDA-event timings after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    """Copy bandwidth (2 GiB buffer, read + write) and bf16 8192^3 matrix rate, on random data."""
    buffers = [torch.randn(2**30, dtype=torch.bfloat16, device="cuda") for _ in range(2)]  # 2 GiB each
    copy_ms = median_ms(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_ms = median_ms(lambda: a @ b)
    return {
        "copy_tbps": 2 * 2**31 / copy_ms / 1e9,
        "bf16_matmul_tflops": 2 * n**3 / mm_ms / 1e9,
    }
