"""Attention backends by config name. Kernel-backed backends import their kernels lazily.

Each backend's `is_available(device, head_dim=, dtype=)` says whether it can run every step of this
model here (kernels that would reject the model's head_dim or dtype at the first request count as
unavailable), so a server that starts can serve.
"""

from __future__ import annotations

import importlib
import logging

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.errors import ConfigError

log = logging.getLogger("kvserve.attention")

# name -> "module:Class"; modules are imported only when picked
BACKENDS: dict[str, str] = {
    "reference": "kvserve.attention.reference:ReferenceBackend",
    "cpu_paged": "kvserve.attention.cpu_paged:CpuPagedBackend",
    "triton": "kvserve.attention.triton_backend:TritonBackend",
    "cuda": "kvserve.attention.cuda_backend:CudaBackend",
}

# what `auto` tries, fastest first; the torch reference runs on any device and is the last resort
# (triton before cuda: both GPU paths still await their first real-GPU run, and cuda JIT-builds)
AUTO_ORDER = {"cuda": ("triton", "cuda"), "cpu": ("cpu_paged",)}


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ConfigError(
            f"attention_backend must be one of auto, {', '.join(BACKENDS)} (got {name!r})",
            param="attention_backend",
        )
    return _load(name)


def _fits(cls: type[AttentionBackend], device: torch.device, facts: dict, windowed: bool) -> tuple[bool, str]:
    if windowed and not cls.takes_window:
        takers = [n for n in BACKENDS if _takes_window(n)]
        return False, f"it takes no sliding-window layers, which this model has ({', '.join(takers)} do)"
    return cls.is_available(device, **facts)


def _takes_window(name: str) -> bool:
    try:
        return _load(name).takes_window
    except ImportError:
        return False


def _availability(name: str, device: torch.device, facts: dict, windowed: bool) -> tuple[bool, str]:
    try:
        cls = _load(name)
    except ImportError as exc:
        return False, f"cannot be imported ({exc})"
    return _fits(cls, device, facts, windowed)


def create_backend(
    name: str,
    device: torch.device,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    windowed: bool = False,
) -> AttentionBackend:
    """A backend that runs on `device` for a model of this head_dim and dtype (None: not checked), and
    with `windowed`, sliding-window layers (AttentionBackend.takes_window).

    `auto`: triton, then the cuda extension on GPUs; cpu_paged on CPU; else the torch reference
    (slow; logged). A named backend that cannot run here is a ConfigError that says what to do.
    """
    facts = {"head_dim": head_dim, "dtype": dtype}
    if name != "auto":
        cls = backend_class(name)
        ok, reason = _fits(cls, device, facts, windowed)
        if not ok:
            raise ConfigError(
                f"attention_backend {name!r} is not available here: {reason}", param="attention_backend"
            )
        return cls()
    reasons = []
    for candidate in AUTO_ORDER.get(device.type, ()):
        ok, reason = _availability(candidate, device, facts, windowed)
        if ok:
            return _load(candidate)()
        reasons.append(f"{candidate}: {reason}")
    ok, reason = _availability("reference", device, facts, windowed)
    if not ok:
        raise ConfigError(
            f"no attention backend runs on {device} ({'; '.join([*reasons, f'reference: {reason}'])})",
            param="attention_backend",
        )
    if reasons:
        log.warning(
            "attention_backend auto: using the torch reference backend on %s, which is slow (%s)",
            device,
            "; ".join(reasons),
        )
    return _load("reference")()
