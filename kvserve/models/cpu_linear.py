"""nn.Linear for fp32 models on CPU: a decode step's few rows through the CPU extension's
`small_batch_linear` (csrc/cpu/linear_cpu.cpp), more rows through torch.

torch's CPU GEMM packs the weight on every call; with weights that come from memory once per step,
8 rows cost about 2.3x one row (a one-off measurement on a 1536 x 576 weight out of cache, one
thread: 0.67 vs 0.29 ms); streaming each weight row once against all rows, 1.8x (0.51 ms). End to
end, decode with 8 requests went from 3.6x to 4.6x one request's tokens/s (docs/prefix-reuse.md).
Same math, summed in a different order: fp32 rounding differences only.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

MAX_ROWS = 16  # kMaxRows in csrc/cpu/linear_cpu.cpp


class SmallBatchLinear(nn.Module):
    """Wraps an nn.Linear (same parameters, nothing copied: a tied lm_head stays tied)."""

    def __init__(self, linear: nn.Linear, ext: ModuleType):
        super().__init__()
        self.linear, self.ext = linear, ext
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if (
            not 1 <= rows.shape[0] <= MAX_ROWS
            or x.dtype != torch.float32
            or not self.linear.weight.is_contiguous()
        ):
            return self.linear(x)
        y = self.ext.small_batch_linear(rows.contiguous(), self.linear.weight, self.linear.bias)
        return y.view(*x.shape[:-1], self.out_features)


def wrap_linears(model: nn.Module, ext: ModuleType) -> int:
    """Wraps every fp32 CPU nn.Linear of `model` in place; returns how many."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, SmallBatchLinear(linear, ext))
    return len(targets)
