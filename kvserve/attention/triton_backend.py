"""Triton paged attention: split-KV decode for pure-decode steps, the FA2 prefill kernel otherwise.

Kernels live in kvserve/kernels/triton/ and are imported on first use. Dense pools are read in
place (fp16, bf16, fp32; head_dim 64 or 128). fp8_e4m3 and int8 (KIVI, open blocks' K from their
full-precision shadows) pools (kvserve/quant/) are read in place by the decode kernel; any other
non-dense pool, and fp8 / int8 for prefill steps, is first gathered into a dense copy of just the
blocks the step references. On CPU the backend runs only under
TRITON_INTERPRET=1 (the parity tests).
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, dense_copy
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV


def fp8_fields(kv: LayerKV) -> tuple[torch.Tensor, ...] | None:
    """(k codes, v codes, k scale, v scale) of an fp8_e4m3 quantized pool, else None."""
    codec = getattr(kv, "codec", None)
    if getattr(codec, "name", None) != "fp8_e4m3":
        return None
    k, v = kv.k_blocks.fields, kv.v_blocks.fields  # type: ignore[attr-defined]
    return k["codes"], v["codes"], k["scale"], v["scale"]


class Int8Fields(NamedTuple):
    """paged_decode's arguments for an int8 KIVI quantized pool (QuantizedLayerKV)."""

    k_codes: torch.Tensor  # [num_blocks, block_size, H_kv, D] uint8
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # [num_blocks, H_kv, D] fp16, per channel over the block
    v_scale: torch.Tensor  # [num_blocks, block_size, H_kv, D // group] fp16, per token and group
    k_zero: torch.Tensor
    v_zero: torch.Tensor
    k_open: torch.Tensor  # OpenKeyShadows.pool: full-precision K of the open blocks
    k_open_slot: torch.Tensor  # OpenKeyShadows.slot_of_block


def int8_fields(kv: LayerKV) -> Int8Fields | None:
    """The codes, scales, zeros and open-block K shadows of an int8 KIVI pool, else None."""
    codec = getattr(kv, "codec", None)
    if getattr(codec, "name", None) != "int8":
        return None
    k, v, shadows = kv.k_blocks.fields, kv.v_blocks.fields, kv.open_k  # type: ignore[attr-defined]
    return Int8Fields(
        k["codes"],
        v["codes"],
        k["scale"],
        v["scale"],
        k["zero"],
        v["zero"],
        shadows.pool,
        shadows.slot_of_block,
    )


class TritonBackend(AttentionBackend):
    name = "triton"

    def forward(
        self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert getattr(meta, "query_positions", None) is None, (
            "rows at arbitrary positions: use the positional backend"
        )
        fp8 = fp8_fields(kv)
        int8 = int8_fields(kv) if meta.is_pure_decode else None
        if int8 is not None:
            from kvserve.kernels.triton.paged_decode import paged_decode

            return paged_decode(
                query, int8.k_codes, int8.v_codes, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                max_seq_len=meta.max_seq_len, scale=scale, k_scale=int8.k_scale, v_scale=int8.v_scale,
                k_zero=int8.k_zero, v_zero=int8.v_zero, k_open=int8.k_open, k_open_slot=int8.k_open_slot,
            )  # fmt: skip
        if meta.is_pure_decode and (isinstance(kv, DenseLayerKV) or fp8 is not None):
            from kvserve.kernels.triton.paged_decode import paged_decode

            k, v, k_scale, v_scale = fp8 if fp8 is not None else (kv.k_cache, kv.v_cache, None, None)  # type: ignore[attr-defined]
            return paged_decode(
                query, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                max_seq_len=meta.max_seq_len, scale=scale, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        if isinstance(kv, DenseLayerKV):
            k, v, block_tables = kv.k_cache, kv.v_cache, meta.block_tables
        else:
            k, v, block_tables = dense_copy(kv, meta.block_tables, query.dtype)
        if meta.is_pure_decode:
            from kvserve.kernels.triton.paged_decode import paged_decode

            args = (query, k, v, block_tables, meta.query_start_loc, meta.seq_lens)
            return paged_decode(*args, max_seq_len=meta.max_seq_len, scale=scale)
        from kvserve.kernels.triton.paged_prefill import paged_prefill

        args = (query, k, v, block_tables, meta.query_start_loc, meta.seq_lens)
        return paged_prefill(*args, max_query_len=meta.max_query_len, scale=scale)

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install triton)"
        if device.type == "cuda":
            return (True, "") if torch.cuda.is_available() else (False, "no CUDA device")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return True, ""
        return (
            False,
            f"triton kernels run on CUDA devices (on CPU only under TRITON_INTERPRET=1), got {device}",
        )
