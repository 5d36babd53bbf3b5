"""The Triton paged prefill's launch choices on a GPU, measured: query rows per program (block_m), KV
tokens per tile (block_n), warps, pipeline stages, and for fp8_e4m3 pools the conversion of the codes
(the hardware cvt to fp16, then to the query's dtype; or integer bits straight to fp32). Runs 5 and 6
found the fp8 prefill at 1.7x the bf16 prefill's time, the whole fp8 TTFT gap, and GQA packing did not
move it (docs/kernels.md); the sm_90 compile check gives 255 registers and 1.2 KB of stack at the
default 64 x 64 tiles on 4 warps, none on 8 warps. This measures each choice instead of guessing.

    python scripts/gpu/sweep_prefill.py [--batch 4] [--contexts 2048 8192] [--json sweep_prefill.json]

Whole causal prompts (bench_kernels' prompt case), Llama-8B heads. Prints every configuration's median
ms, TFLOP/s and its largest difference from the default launch's output, then per (KV format, context)
the fastest against the default, and SDPA's flash backend on contiguous KV as the ceiling.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvserve.attention.testing import make_batch, quantized_copy
from kvserve.kernels.paged_kv import paged_kv
from kvserve.kernels.triton.paged_prefill import paged_prefill

# (block_m, block_n, num_warps, num_stages or None for Triton's default); the first is the launcher's default
LAUNCHES = [
    (64, 64, 4, None),
    (64, 64, 8, None),
    (64, 32, 4, None),
    (128, 32, 8, None),
    (128, 64, 8, None),
    (128, 64, 8, 2),
    (64, 64, 4, 2),
    (128, 128, 8, None),
]


def flash_ms(query: torch.Tensor, batch: int, ctx: int) -> float:
    """Causal SDPA on the flash backend over [B, H, S, D] with K, V of every query head (the ceiling)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = query.view(batch, ctx, *query.shape[1:]).transpose(1, 2)
    k = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True),
            warmup=5, rep=40, return_mode="median",
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--kv", nargs="+", default=["dense", "fp8_e4m3"])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("H", "H_KV", "D"))
    ap.add_argument("--converts", nargs="+", default=["native", "fp32"], help="fp8 conversions to try")
    ap.add_argument("--check-args", action="store_true", help="parse and import, then stop (the CPU dry run)")
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args()
    if args.check_args:
        return print("arguments ok")
    import triton.testing

    h, h_kv, d = args.heads
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for ctx in args.contexts:
        query, dense, meta = make_batch(
            [(ctx, ctx)] * args.batch, h, h_kv, d, 16, torch.bfloat16, "shuffled", device="cuda"
        )
        flops = 4 * args.batch * h * d * ctx * (ctx + 1) / 2  # QK^T and PV over the causal half
        sdpa_ms = flash_ms(query, args.batch, ctx)
        print(
            f"## context {ctx}: SDPA flash {sdpa_ms:.3f} ms ({flops / sdpa_ms / 1e9:.0f} TFLOP/s)", flush=True
        )
        for kv in args.kv:
            pool = dense if kv == "dense" else quantized_copy(dense, meta, kv, torch.bfloat16)
            view = paged_kv(pool, torch.bfloat16)
            assert view is not None, kv
            call = (query, view.k_cache, view.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
            scales = dict(k_scale=view.k_scale, v_scale=view.v_scale) if kv == "fp8_e4m3" else {}

            def run(launch, convert):
                block_m, block_n, warps, stages = launch
                extra = dict(scales, fp8_convert=convert) if convert else scales  # noqa: B023
                return paged_prefill(
                    *call, max_query_len=ctx, scale=d**-0.5, block_m=block_m, block_n=block_n,  # noqa: B023
                    num_warps=warps, num_stages=stages, **extra,
                )  # fmt: skip

            reference = run(LAUNCHES[0], None)
            default_ms = triton.testing.do_bench(
                lambda: run(LAUNCHES[0], None), warmup=5, rep=40, return_mode="median"
            )
            found = []
            for launch in LAUNCHES:
                for convert in args.converts if kv == "fp8_e4m3" else [None]:
                    try:
                        out = run(launch, convert)
                        err = (out.float() - reference.float()).abs().max().item()
                        ms = triton.testing.do_bench(
                            lambda launch=launch, convert=convert: run(launch, convert),
                            warmup=5, rep=40, return_mode="median",
                        )  # fmt: skip
                    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a finding
                        print(f"{kv:<9} {ctx:>6} {launch} {convert}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    row = dict(kv=kv, context=ctx, batch=args.batch, block_m=launch[0], block_n=launch[1],
                               num_warps=launch[2], num_stages=launch[3], fp8_convert=convert, ms=ms,
                               tflops=flops / ms / 1e9, max_abs_diff=err, default_ms=default_ms,
                               sdpa_ms=sdpa_ms)  # fmt: skip
                    rows.append(row)
                    found.append(row)
                    print(
                        f"{kv:<9} {ctx:>6} bm {launch[0]:>3} bn {launch[1]:>3} warps {launch[2]} "
                        f"stages {launch[3]!s:<4} {convert!s:<6} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s "
                        f"x SDPA {sdpa_ms / ms:4.2f}  (|diff| {err:.1e})",
                        flush=True,
                    )
            if found:
                best = min(found, key=lambda r: r["ms"])
                print(
                    f"## best {kv} {ctx}: {best['ms']:.3f} ms (x SDPA {sdpa_ms / best['ms']:.2f}) with bm "
                    f"{best['block_m']} bn {best['block_n']} warps {best['num_warps']} stages "
                    f"{best['num_stages']} {best['fp8_convert'] or ''}; default {default_ms:.3f} ms "
                    f"(x SDPA {sdpa_ms / default_ms:.2f})",
                    flush=True,
                )
            del pool
        del dense, query
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
