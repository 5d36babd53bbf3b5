"""nn.Linear for fp32 and bf16 models on CPU through the CPU extension's `row_linear` / `row_linear_bf16`
(csrc/cpu/linear_cpu.cpp), for every row count.

Why not torch: its CPU GEMM picks a different summation order depending on the number of rows (on the
dev machine a row's fp32 result differed between 1 and 4+ rows), so a token's projections depended on
what else was in the step: a decode row next to another sequence's prefill, the last prompt token
recomputed alone on a full prefix hit, or a prompt split differently into prefill slices. Through
`row_linear` every output element is one fixed sum whatever the row count, the tiling and the thread
count (batch invariance; docs/kernels.md has the guarantee and what it cost).

The kernel reads the weight packed into panels of output features (`pack_linear_weight`, done once
here): a second copy of every wrapped weight, the price of a GEMM with no horizontal sums (about
540 MB more for SmolLM2-135M in fp32; the parameters themselves are kept, so a tied lm_head stays tied
to the embedding and the module stays an ordinary Linear to anything that reads `.weight`). In bf16 the
copy is half that, and the kernel sums each output in fp32 over pairs of inputs (AVX-512 BF16's
`vdpbf16ps` where the CPU has it), rounding once to bf16 at the end.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RowInvariantLinear(nn.Module):
    """Wraps an nn.Linear (same parameters; the weight packed once for the kernel). Pack again with
    `repack()` after changing the weight in place."""

    def __init__(self, linear: nn.Linear, ext: ModuleType):
        super().__init__()
        self.linear, self.ext = linear, ext
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = self.repack()

    @torch.no_grad()
    def repack(self) -> torch.Tensor:
        weight = self.linear.weight.detach()
        self.dtype = weight.dtype
        bf16 = self.dtype == torch.bfloat16
        pack = self.ext.pack_linear_weight_bf16 if bf16 else self.ext.pack_linear_weight
        self.kernel = self.ext.row_linear_bf16 if bf16 else self.ext.row_linear  # reads what pack wrote
        self.packed = pack(weight)  # fp32 [panels, in, lanes]; bf16 [panels, in / 2, lanes * 2]
        return self.packed

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu":
            return self.linear(x)  # not what wrap_linears wraps; kept correct, not invariant
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = self.kernel(rows, self.packed, self.linear.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


WRAPPED_DTYPES = (torch.float32, torch.bfloat16)


def wrap_linears(model: nn.Module, ext: ModuleType) -> int:
    """Wraps every fp32 or bf16 CPU nn.Linear of `model` in place; returns how many."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype in WRAPPED_DTYPES
        and module.weight.device.type == "cpu"
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RowInvariantLinear(linear, ext))
    return len(targets)
