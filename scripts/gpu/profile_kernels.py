"""One launch of an attention kernel for Nsight Compute (ncu) to read: the kernels that missed their
targets in the first GPU run, measured rather than guessed at. Builds the batch, warms the kernel up,
then runs it once between cudaProfilerStart and cudaProfilerStop (ncu --profile-from-start off).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python scripts/gpu/profile_kernels.py --backend cuda --case decode --kv dense
"""

from __future__ import annotations

import argparse

import torch

from kvserve.attention.registry import create_backend
from kvserve.attention.testing import make_batch, quantized_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cuda", "triton", "nested"], required=True)
    ap.add_argument(
        "--case", choices=["decode", "prompt", "fp16", "fp8"], required=True,
        help="attention: decode or prompt; nested (the NestedFP Triton linear, 4096 rows of gate/up): fp16 or fp8 mode",
    )  # fmt: skip
    ap.add_argument("--kv", default="dense", help="dense or a kv_cache_dtype (fp8_e4m3, int8, mxfp4)")
    ap.add_argument("--batch", type=int, default=0, help="default: 64 for decode, 4 for prompt")
    ap.add_argument("--ctx", type=int, default=0, help="default: 8192 for decode, 4096 for prompt")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("H", "H_KV", "D"))
    ap.add_argument("--check-args", action="store_true", help="parse and import, then stop (the CPU dry run)")
    args = ap.parse_args()
    if args.check_args:
        return print("arguments ok")
    if args.backend == "nested":
        return profile_nested(args.case == "fp16")
    batch = args.batch or (64 if args.case == "decode" else 4)
    ctx = args.ctx or (8192 if args.case == "decode" else 4096)
    q_len = 1 if args.case == "decode" else ctx
    h, h_kv, d = args.heads
    query, kv, meta = make_batch(
        [(q_len, ctx)] * batch, h, h_kv, d, 16, torch.bfloat16, "shuffled", device="cuda"
    )
    pool = kv if args.kv == "dense" else quantized_copy(kv, meta, args.kv, torch.bfloat16)
    backend = create_backend(args.backend, torch.device("cuda"))
    for _ in range(3):
        backend.forward(query, pool, meta, d**-0.5)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    backend.forward(query, pool, meta, d**-0.5)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.backend} {args.case} {args.kv}: batch {batch}, context {ctx}")


def profile_nested(fp16: bool) -> None:
    """The NestedFP linear at 4096 rows of Llama-8B's gate/up projection (4096 -> 28672), with the
    fastest launch of the first GPU run (docs/kernels.md)."""
    from kvserve.kernels.triton.nested_linear import nested_linear
    from kvserve.quant.nestedfp import NestedWeight

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = NestedWeight.from_float((torch.randn(28672, 4096, device="cuda", generator=gen) * 0.05).float())
    x = torch.randn(4096, 4096, device="cuda", generator=gen).half()
    launch = (128, 256, 64, 8, 3)
    for _ in range(3):
        nested_linear(x, w.hi, w.lo, w.scale, fp16, *launch)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    nested_linear(x, w.hi, w.lo, w.scale, fp16, *launch)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled nested {'fp16' if fp16 else 'fp8'} mode: 4096 x 4096 -> 28672, launch {launch}")


if __name__ == "__main__":
    main()
