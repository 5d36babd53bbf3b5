"""kvserve: an OpenAI-compatible inference server that makes repeated context cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.config import ServeConfig
    from kvserve.llm import LLM
    from kvserve.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "ServeConfig"]
__version__ = "0.1.0"

_HOMES = {"LLM": "kvserve.llm", "SamplingParams": "kvserve.request", "ServeConfig": "kvserve.config"}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use, so that importing a light module of the package
    (kvserve.structured.schema in its own process) does not import torch."""
    if name not in _HOMES:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
