"""Attention backends by config name. Kernel-backed backends import their kernels lazily."""

from __future__ import annotations

import importlib

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.errors import ConfigError

# name -> "module:Class"; modules are imported only when picked
BACKENDS: dict[str, str] = {
    "reference": "kvserve.attention.reference:ReferenceBackend",
    "cpu_paged": "kvserve.attention.cpu_paged:CpuPagedBackend",
    "triton": "kvserve.attention.triton_backend:TritonBackend",
    "cuda": "kvserve.attention.cuda_backend:CudaBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend must be one of auto, {', '.join(BACKENDS)} (got {name!r})")
    return _load(name)


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: triton, then the cuda extension on GPUs; cpu_paged on CPU."""
    if name == "auto":
        # triton first: both GPU paths still await their first real-GPU run, and cuda JIT-builds (minutes)
        candidates = ["triton", "cuda"] if device.type == "cuda" else ["cpu_paged"]
        for candidate in candidates:
            try:
                cls = _load(candidate)
            except ImportError:
                continue
            ok, _ = cls.is_available(device)
            if ok:
                return cls()
        return _load("cpu_paged")()
    cls = backend_class(name)
    ok, reason = cls.is_available(device)
    if not ok:
        raise ConfigError(f"attention_backend {name!r} is not available here: {reason}")
    return cls()
