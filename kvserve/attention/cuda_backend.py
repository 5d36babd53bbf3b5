"""CUDA-extension paged attention (csrc/): one FlashAttention-2 kernel with GQA row packing for
prefill, chunked prefill and decode, split-KV (flash-decoding) when the grid is too small.

Pools read in place, for every step kind: dense fp16 / bf16, fp8_e4m3 and int8 (KIVI) quantized
pools (kvserve/quant/; the kernel dequantizes while loading its K/V tiles). Any other pool format
(mxfp4 too, which only the Triton decode kernel reads in place) is first gathered into a dense copy
of only the blocks the step references (`dense_copy`), so every codec works, at the cost of that
copy. head_dim 64 or 128, compute capability >= 8.0. The extension is built on first use through
kvserve/kernels/cuda_ext.py.
"""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, dense_copy
from kvserve.kernels.paged_kv import paged_kv
from kvserve.kvcache.kv_storage import LayerKV


class CudaBackend(AttentionBackend):
    name = "cuda"

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        assert not window, f"{self.name} takes no sliding window (takes_window is False)"
        assert getattr(meta, "query_positions", None) is None, (
            "rows at arbitrary positions: use the positional backend"
        )
        from kvserve.kernels import cuda_ext

        pool = paged_kv(kv, query.dtype)
        if pool is not None and pool.kv_format in cuda_ext.KV_FORMATS:  # dense, fp8_e4m3 or int8: in place
            return cuda_ext.paged_attention(
                query, pool.k_cache, pool.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
                kv_format=pool.kv_format, **pool.extras(),
            )  # fmt: skip
        k, v, block_tables = dense_copy(kv, meta.block_tables, query.dtype)
        return cuda_ext.paged_attention(
            query, k, v, block_tables, meta.query_start_loc, meta.seq_lens,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
        )  # fmt: skip

    @classmethod
    def is_available(
        cls, device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """CUDA devices with compute capability >= 8.0 where the extension builds; the launcher's head
        dims and dtypes (cuda_ext.paged_attention), checked here so no request meets them. Builds the
        extension (minutes the first time) once the cheap checks pass."""
        from kvserve.kernels import cuda_ext

        if device.type != "cuda":
            return False, (
                f"the CUDA extension runs on CUDA devices, got {device}: use --attention-backend auto or cpu_paged"
            )
        if head_dim is not None and head_dim not in (64, 128):  # check_paged_args' head_dims
            return False, (
                f"the CUDA extension takes head_dim 64 or 128, this model has head_dim {head_dim}: "
                "use --attention-backend auto (on GPUs: the torch reference, slow)"
            )
        if dtype is not None and dtype not in cuda_ext.COMPUTE_DTYPES:
            return False, (
                f"the CUDA extension computes in float16 or bfloat16, got {dtype}: use --dtype bfloat16 "
                "(or float16), or --attention-backend triton"
            )
        reason = cuda_ext.unavailable_reason()
        if reason:
            return False, f"{reason}: use --attention-backend auto"
        try:
            cuda_ext.load()
        except Exception as exc:  # noqa: BLE001 - a failed build makes the backend unavailable
            return (
                False,
                f"building the CUDA extension failed ({str(exc)[-500:]}): use --attention-backend auto",
            )
        return True, ""
