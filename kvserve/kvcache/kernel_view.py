"""What a kernel reads of a layer's pool in place: one description for every backend.

Each `LayerKV` describes itself (`LayerKV.kernel_view`): the tensors that the CPU extension, the
Triton decode kernel and the CUDA extension read without a copy, and their format; None when no
kernel reads the pool in place (the backend then takes a dense copy, attention/base.py), as it does
for a format its own kernels do not read (`kv_format`: mxfp4 is read by Triton decode only). It lives
here, not in kvserve/kernels/, so storage can build it without importing kernels;
kvserve/kernels/paged_kv.py re-exports it. Take it at call time: an int8 pool's open-K shadow
tensor is replaced when it grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PagedKV:
    """The tensors of one layer's pool that kernels read in place, and their format.

    dense: k_cache / v_cache hold values [num_blocks, block_size, H_kv, D].
    fp8_e4m3: uint8 codes; k_scale, v_scale fp32 [num_blocks, block_size, H_kv].
    mxfp4: uint8 codes [num_blocks, block_size, H_kv, D // 2], two E2M1 codes a byte (channel 2i in
    the low nibble); k_scale, v_scale uint8 UE8M0 exponents [num_blocks, block_size, H_kv, D // 32].
    Only the Triton decode kernel reads it; the CPU and CUDA extensions take a dense copy.
    int8: uint8 codes; k_scale, k_zero fp16 [num_blocks, H_kv, D]; v_scale, v_zero fp16 [num_blocks,
    block_size, H_kv, D // 64]; k_open [capacity, block_size, H_kv, D] (K of open blocks, in the
    compute dtype) and k_open_slot int32 [num_blocks] (row of k_open holding a block's K, -1: read
    its codes).
    """

    kv_format: str  # dense, fp8_e4m3, mxfp4 or int8
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    k_open: torch.Tensor | None = None
    k_open_slot: torch.Tensor | None = None

    def extras(self) -> dict[str, Any]:
        """The format's tensors past the caches, as the launchers' keyword arguments."""
        return {
            "k_scale": self.k_scale,
            "k_zero": self.k_zero,
            "v_scale": self.v_scale,
            "v_zero": self.v_zero,
            "k_open": self.k_open,
            "k_open_slot": self.k_open_slot,
        }
