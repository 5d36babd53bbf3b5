"""A model's checkpoint as the weight benchmarks read it (scripts/nestedfp_report.py,
scripts/bench_weights.py): its safetensors tensors by name, and its linear weights."""

from __future__ import annotations

import torch

from kvserve.models.loader import resolve_model_path


def checkpoint(model: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's safetensors files (a builtin name or a local directory), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(resolve_model_path(model).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def linear_weights(model: str) -> dict[str, torch.Tensor]:
    # 2-D weights other than the embedding (SmolLM2 ties its LM head to it: a lookup table, not a GEMV)
    return {k: v for k, v in checkpoint(model).items() if v.ndim == 2 and "embed_tokens" not in k}
