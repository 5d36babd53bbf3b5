"""What a kernel reads of a layer's pool in place: one description for every backend.

`paged_kv(kv, dtype)` gives the tensors of a `LayerKV` that the CPU extension, the Triton decode
kernel and the CUDA extension read without a copy, and their format; None when the pool is in a
format no kernel reads in place (the backend then takes a dense copy, attention/base.py). Read it at
call time: an int8 pool's `open_k.pool` is replaced when it grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV


@dataclass(frozen=True)
class PagedKV:
    """The tensors of one layer's pool that kernels read in place, and their format.

    dense: k_cache / v_cache hold values [num_blocks, block_size, H_kv, D].
    fp8_e4m3: uint8 codes; k_scale, v_scale fp32 [num_blocks, block_size, H_kv].
    int8: uint8 codes; k_scale, k_zero fp16 [num_blocks, H_kv, D]; v_scale, v_zero fp16 [num_blocks,
    block_size, H_kv, D // 64]; k_open [capacity, block_size, H_kv, D] (K of open blocks, in the
    compute dtype) and k_open_slot int32 [num_blocks] (row of k_open holding a block's K, -1: read
    its codes).
    """

    kv_format: str  # dense, fp8_e4m3 or int8
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


def paged_kv(kv: LayerKV, dtype: torch.dtype | None = None) -> PagedKV | None:
    """`kv` as kernels read it in place, or None. With `dtype` (GPU kernels, whose values must be in
    the query dtype): None also for a stored-as-is pool in another dtype and for an int8 pool whose
    open-K shadows are in another dtype. Without (the CPU extension converts any float dtype): any
    dense or stored-as-is pool (e.g. bf16 KV under fp32 compute)."""
    if isinstance(kv, DenseLayerKV):
        return PagedKV("dense", kv.k_cache, kv.v_cache)
    codec = getattr(kv, "codec", None)
    if codec is None:
        return None
    k, v = kv.k_blocks.fields, kv.v_blocks.fields  # type: ignore[attr-defined]
    if codec.passthrough_dtype is not None:
        same = dtype is None or codec.passthrough_dtype == dtype
        return PagedKV("dense", k["x"], v["x"]) if same else None
    if codec.name == "fp8_e4m3":
        return PagedKV("fp8_e4m3", k["codes"], v["codes"], k_scale=k["scale"], v_scale=v["scale"])
    if codec.name != "int8":
        return None
    open_k = kv.open_k  # type: ignore[attr-defined]
    if dtype is not None and open_k.pool.dtype != dtype:
        return None
    return PagedKV(
        "int8", k["codes"], v["codes"], k_scale=k["scale"], k_zero=k["zero"], v_scale=v["scale"],
        v_zero=v["zero"], k_open=open_k.pool, k_open_slot=open_k.slot_of_block,
    )  # fmt: skip
