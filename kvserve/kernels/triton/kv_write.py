"""The KV write of a dense pool on CUDA: each new token's K and V rows copied into its pool slot, slot -1
skipped on the device. It stands in for DenseLayerKV.write_torch, whose mask of unwritten rows
(`bool(keep.all())`) synchronizes with the host once per layer and step; the engine builder attaches
it as the pool's `copy_rows`, as it does the CPU extension's kv_write_ on the CPU (storage does not
import kernels). One program per (token, KV head); a slot past the pool is not written either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dense_write_kernel(
    k_cache_ptr, v_cache_ptr, slot_ptr, k_ptr, v_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads, num_slots,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        offs = tl.arange(0, HEAD_DIM)
        row = (slot * num_kv_heads + h) * HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs)
        tl.store(k_cache_ptr + row + offs, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + row + offs, v.to(v_cache_ptr.dtype.element_ty))


def dense_kv_write(
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 or int32; -1 = skip
    key: torch.Tensor,  # [T, H_kv, D] in the pool's dtype, any strides
    value: torch.Tensor,
) -> None:
    """DenseLayerKV.copy_rows on CUDA (the CPU extension's kv_write_ signature)."""
    t, h, d = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (h, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit the pool {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the pool must be contiguous")
    key = key if key.stride(-1) == 1 else key.contiguous()  # rows are read with unit stride in head_dim
    value = value if value.stride(-1) == 1 else value.contiguous()
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"key/value must have the pool's dtype {k_cache.dtype}, got {key.dtype}")
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if slot_mapping.shape != (t,) or slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping must be [{t}] on {key.device}")
    if t:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        _dense_write_kernel[(t, h)](
            k_cache, v_cache, slot_mapping, key, value,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), h, num_slots, HEAD_DIM=d,
        )  # fmt: skip
