"""y = (x W^T) * scale over NestedFP planes (kvserve/quant/nestedfp.py) in Triton, for GPUs.

One program per (BLOCK_M rows, BLOCK_N outputs), looping over the inputs in BLOCK_K steps. Each step
loads the `hi` bytes (FP8 mode) or both planes (FP16 mode) of its [BLOCK_N, BLOCK_K] weight tile and
builds FP16 bit patterns with integer operations: FP8 mode sign | (hi & 0x7F) << 7 (the E4M3 view
divided by 2^8 is exactly that FP16 value), FP16 mode sign | A << 8 | lo with A = ((hi & 0x7F) -
(lo >> 7)) >> 1. No float -> fp8 cast is involved (it is wrong under TRITON_INTERPRET=1). The tile is
converted to x's dtype and multiplied with fp32 accumulation (tl.dot); the epilogue multiplies each
output by its row's power-of-two scale. FP8 values are exact in fp16 and bf16; FP16 mode is exact in
fp16 and fp32 activations, not in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def nested_linear_kernel(
    x_ptr,
    hi_ptr,
    lo_ptr,
    scale_ptr,
    y_ptr,  # [M, N] in x's dtype, or SPLIT_K > 1: [SPLIT_K, M, N] fp32 partial sums, unscaled
    M,
    N,
    K,
    FP16: tl.constexpr,
    X_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,  # the weight tile as the dot's first operand: acc^T = W x^T (see nested_linear)
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_end = tl.minimum(K, (split + 1) * k_per)
    for k0 in range(split * k_per, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < k_end), other=0.0
        )
        w_mask = (rn[:, None] < N) & (rk[None, :] < k_end)
        hi = tl.load(hi_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0).to(tl.int32)
        sign = (hi & 0x80) << 8
        if FP16:
            lo = tl.load(lo_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0).to(tl.int32)
            a = ((hi & 0x7F) - (lo >> 7)) >> 1
            bits = sign | (a << 8) | lo
        else:
            bits = sign | ((hi & 0x7F) << 7)
        w = bits.to(tl.int16).to(tl.float16, bitcast=True).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        if SWAP and X_FP32:  # fp32 products, not TF32
            acc += tl.dot(w, tl.trans(x), input_precision="ieee", out_dtype=tl.float32)
        elif SWAP:
            acc += tl.dot(w, tl.trans(x), out_dtype=tl.float32)
        elif X_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    if SWAP:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        out = acc
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.store(y_ptr + split * M * N + rm[:, None] * N + rn[None, :], out, mask=mask)
    else:
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
        out = out * scale[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def nested_linear(
    x: torch.Tensor,
    hi: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    fp16: bool,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    swap: bool = False,
    split_k: int = 1,
) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) times the NestedFP weight [N, K]^T, times scale [N]: [M, N] in x's
    dtype. FP8 mode (fp16=False) reads `hi` only; `lo` may be any tensor then. The block shape, warps
    and pipeline stages are the Triton launch's (scripts/gpu/bench_nested.py measures them).

    swap: the rebuilt weight tile is the dot's first operand (y^T = W x^T), which Hopper's wgmma may
    read from registers, so the tile is not stored to shared memory between the integer operations and
    the product; block_n is then the product's M side (64 or more for wgmma) and block_m its N side.
    split_k > 1: the inputs are cut into split_k ranges, each program writes an fp32 partial sum, and
    the partials are added in order (torch) and scaled: more programs for few rows (a skinny product
    reads the whole weight with only N / block_n programs otherwise)."""
    if x.dim() != 2 or hi.dim() != 2 or x.shape[1] != hi.shape[1] or lo.shape != hi.shape:
        raise ValueError(f"x [M, K] and planes [N, K] needed (got {tuple(x.shape)}, {tuple(hi.shape)})")
    if hi.dtype != torch.uint8 or lo.dtype != torch.uint8:
        raise ValueError("the planes must be uint8")
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    m, k = x.shape
    n = hi.shape[0]
    if split_k > 1:
        y = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    scale = scale.float().contiguous()
    nested_linear_kernel[grid](
        x.contiguous(), hi.contiguous(), lo.contiguous(), scale, y, m, n, k,
        FP16=fp16, X_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SWAP=swap, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split_k > 1:
        return (y.sum(0) * scale).to(x.dtype)
    return y
