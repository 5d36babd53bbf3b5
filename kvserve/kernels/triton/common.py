"""Small facts shared by the Triton launchers."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # the kernels use exp2: softmax scale is multiplied by log2(e)


def dot_fp32(query: torch.Tensor) -> bool:
    """True where tl.dot must run in fp32: bf16 on the CPU interpreter (its bf16 dot is wrong)."""
    return query.device.type == "cpu" and query.dtype == torch.bfloat16
