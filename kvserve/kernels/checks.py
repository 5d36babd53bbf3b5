"""Argument checks shared by the kernel launchers (Triton and CUDA): run before every launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedShape:
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_paged_args(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES,
    head_dims: tuple[int, ...] = (64, 128),
    kv_dtype: torch.dtype | None = None,  # cache dtype when it differs from query's (fp8 codes: uint8)
    codes_per_byte: int = 1,  # channels per cache element: 2 for packed 4-bit codes (mxfp4)
) -> PagedShape:
    """Shapes, dtypes, strides and devices of a paged attention call; ValueError naming the problem.
    The caches' last dim is head_dim // codes_per_byte."""
    require(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    require(
        k_cache.dim() == 4,
        f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}",
    )
    require(
        k_cache.shape == v_cache.shape,
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ",
    )
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_bytes = k_cache.shape
    kv_head_dim = kv_bytes * codes_per_byte
    require(head_dim == kv_head_dim, f"query head_dim {head_dim} != cache head_dim {kv_head_dim}")
    require(head_dim in head_dims, f"head_dim must be one of {head_dims}, got {head_dim}")
    require(block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}")
    require(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    require(query.dtype in dtypes, f"query dtype must be one of {dtypes}, got {query.dtype}")
    require(
        k_cache.dtype == (kv_dtype or query.dtype) == v_cache.dtype,
        f"query, k_cache, v_cache dtypes differ: {query.dtype}, {k_cache.dtype}, {v_cache.dtype}",
    )
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        require(t.stride(-1) == 1, f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        require(t.is_contiguous(), f"{name} must be contiguous")
    num_seqs = seq_lens.shape[0]
    require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}",
    )
    require(
        query_start_loc.shape == (num_seqs + 1,),
        f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}",
    )
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)}
    require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return PagedShape(num_seqs, num_heads, num_kv_heads, head_dim, block_size)


def check_scales(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_cache: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    groups: int = 0,
) -> None:
    """Per-slot scales of a pool of codes, slot-major. fp8_e4m3: one fp32 per (slot, kv head),
    [num_blocks, block_size, H_kv]. mxfp4 (dtype uint8, groups = head_dim // 32): one UE8M0 exponent
    per (slot, kv head, group of 32 channels), [num_blocks, block_size, H_kv, groups]."""
    shape = (*k_cache.shape[:3], groups) if groups else tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        require(t is not None, f"{name} is required with quantized caches")
        assert t is not None
        require(t.dtype == dtype, f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
        require(tuple(t.shape) == shape, f"{name} must be {shape}, got {tuple(t.shape)}")
        require(
            t.stride(-1) == 1 and t.device == k_cache.device,
            f"{name} must be contiguous per slot, on {k_cache.device}",
        )
    assert k_scale is not None and v_scale is not None
    require(k_scale.stride() == v_scale.stride(), "k_scale and v_scale strides differ")


def check_int8_fields(
    query: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] uint8 codes
    k_scale: torch.Tensor | None,  # [num_blocks, H_kv, D] fp16
    v_scale: torch.Tensor | None,  # [num_blocks, block_size, H_kv, D // group] fp16
    k_zero: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    k_open: torch.Tensor | None,  # [capacity, block_size, H_kv, D] query dtype
    k_open_slot: torch.Tensor | None,  # [num_blocks] int32
) -> int:
    """The int8 KIVI operands of Triton's paged_decode; returns the V group size (channels per scale)."""
    fields = dict(k_scale=k_scale, v_scale=v_scale, k_zero=k_zero, v_zero=v_zero, k_open=k_open)
    fields["k_open_slot"] = k_open_slot
    missing = [name for name, t in fields.items() if t is None]
    require(not missing, f"int8 caches need {', '.join(missing)}")
    assert k_scale is not None and v_scale is not None and k_zero is not None and v_zero is not None
    assert k_open is not None and k_open_slot is not None
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    groups = v_scale.shape[-1] if v_scale.dim() == 4 else 0
    expected = {
        "k_scale": (num_blocks, num_kv_heads, head_dim),
        "k_zero": (num_blocks, num_kv_heads, head_dim),
        "v_scale": (num_blocks, block_size, num_kv_heads, groups),
        "v_zero": (num_blocks, block_size, num_kv_heads, groups),
    }
    for name, shape in expected.items():
        t = fields[name]
        assert t is not None
        require(t.dtype == torch.float16, f"{name} must be float16, got {t.dtype}")
        require(tuple(t.shape) == shape, f"{name} must be {shape}, got {tuple(t.shape)}")
        require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    require(
        groups > 0 and groups & (groups - 1) == 0 and head_dim % groups == 0,
        f"v_scale groups must be a power of two dividing head_dim {head_dim}, got {groups}",
    )
    require(k_scale.stride() == k_zero.stride(), "k_scale and k_zero strides differ")
    require(v_scale.stride() == v_zero.stride(), "v_scale and v_zero strides differ")
    require(k_open.dtype == query.dtype, f"k_open must be {query.dtype}, got {k_open.dtype}")
    require(
        k_open.dim() == 4 and tuple(k_open.shape[1:]) == (block_size, num_kv_heads, head_dim),
        f"k_open must be [capacity, {block_size}, {num_kv_heads}, {head_dim}], got {tuple(k_open.shape)}",
    )
    require(k_open.stride(-1) == 1, "k_open must be contiguous in head_dim")
    require(
        k_open_slot.dtype == torch.int32 and tuple(k_open_slot.shape) == (num_blocks,),
        f"k_open_slot must be int32 [{num_blocks}], got {k_open_slot.dtype} {tuple(k_open_slot.shape)}",
    )
    require(k_open_slot.is_contiguous(), "k_open_slot must be contiguous")
    devices = {t.device for t in fields.values() if t is not None} | {k_cache.device}
    require(len(devices) == 1, f"int8 fields must be on {k_cache.device}, got {sorted(map(str, devices))}")
    return head_dim // groups
