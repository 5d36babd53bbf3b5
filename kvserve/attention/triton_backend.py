"""Triton paged attention: split-KV decode for pure-decode steps, the FA2 prefill kernel otherwise, and
for every step of a sliding-window layer (the prefill kernel takes the window; decode rows are valid
input to it).

Kernels live in kvserve/kernels/triton/ and are imported on first use. Dense pools are read in
place (fp16, bf16, fp32; head_dim 64 or 128). fp8_e4m3, mxfp4 and int8 (KIVI, open blocks' K from
their full-precision shadows) pools (kvserve/quant/) are read in place by the decode kernel, and
fp8_e4m3 by the prefill kernel too; any other non-dense pool, and mxfp4 / int8 for prefill steps, is
first gathered into a dense copy of just the blocks the step references. On CPU the backend runs only under
TRITON_INTERPRET=1 (the parity tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, dense_copy
from kvserve.kernels.paged_kv import PagedKV, paged_kv
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV


class TritonBackend(AttentionBackend):
    name = "triton"
    takes_window = True

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        assert getattr(meta, "query_positions", None) is None, (
            "rows at arbitrary positions: use the positional backend"
        )
        pool = paged_kv(kv, query.dtype)
        if window:  # a sliding-window layer: every step through the prefill kernel (decode rows too)
            return self._prefill(query, kv, pool, meta, scale, window)
        if pool is not None and meta.is_pure_decode:  # dense, fp8_e4m3, mxfp4 or int8: read in place
            from kvserve.kernels.triton.paged_decode import paged_decode

            return paged_decode(
                query, pool.k_cache, pool.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                max_seq_len=meta.max_seq_len, scale=scale, **pool.extras(),
            )  # fmt: skip
        if meta.is_pure_decode and pool is None:
            from kvserve.kernels.triton.paged_decode import paged_decode

            k, v, block_tables = dense_copy(kv, meta.block_tables, query.dtype)
            args = (query, k, v, block_tables, meta.query_start_loc, meta.seq_lens)
            return paged_decode(*args, max_seq_len=meta.max_seq_len, scale=scale)
        return self._prefill(query, kv, pool, meta, scale, None)

    @staticmethod
    def _prefill(
        query: torch.Tensor, kv: LayerKV, pool: PagedKV | None, meta: AttentionMetadata, scale: float,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """The prefill kernel: dense and fp8_e4m3 pools in place, others through a dense copy."""
        from kvserve.kernels.triton.paged_prefill import paged_prefill

        k_scale = v_scale = None
        if pool is not None and pool.kv_format == "fp8_e4m3":  # the prefill kernel reads fp8 in place too
            k, v, block_tables = pool.k_cache, pool.v_cache, meta.block_tables
            k_scale, v_scale = pool.k_scale, pool.v_scale
        elif isinstance(kv, DenseLayerKV):
            k, v, block_tables = kv.k_cache, kv.v_cache, meta.block_tables
        else:
            k, v, block_tables = dense_copy(kv, meta.block_tables, query.dtype)
        return paged_prefill(
            query, k, v, block_tables, meta.query_start_loc, meta.seq_lens, max_query_len=meta.max_query_len,
            scale=scale, k_scale=k_scale, v_scale=v_scale, window=window,
        )  # fmt: skip

    @classmethod
    def is_available(
        cls, device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """CUDA devices (CPU only under TRITON_INTERPRET=1, the parity tests); the launchers' head dims
        and dtypes (kvserve/kernels/checks.py check_paged_args), checked here so no request meets them."""
        from kvserve.kernels.checks import KERNEL_DTYPES

        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            return False, (
                f"triton kernels run on CUDA devices (on CPU only under TRITON_INTERPRET=1), got {device}: "
                "use --attention-backend auto or cpu_paged"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            return False, "no CUDA device is visible (torch.cuda.is_available() is False): use --device cpu"
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed: pip install triton, or use --attention-backend auto"
        if head_dim is not None and head_dim not in (64, 128):  # check_paged_args' head_dims
            return False, (
                f"the triton kernels take head_dim 64 or 128, this model has head_dim {head_dim}: "
                "use --attention-backend auto (on GPUs: the torch reference, slow)"
            )
        if dtype is not None and dtype not in KERNEL_DTYPES:
            return False, f"the triton kernels compute in {KERNEL_DTYPES}, got {dtype}: use --dtype bfloat16"
        return True, ""
