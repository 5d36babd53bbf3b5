"""The Triton paged decode's launch choices on a GPU, measured: programs per SM (target_programs, which
sets the number of KV splits), tokens per tile (block_n), warps, and the fp8 conversion (integer bit
trick or the hardware cvt). The first GPU run found bf16 decode at 42-58 % of HBM at 4k-8k with one
split per (sequence, KV head) at batch 64, and fp8 / mxfp4 slower than bf16 (docs/kernels.md); this
measures what each choice does instead of guessing.

    python scripts/gpu/sweep_decode.py [--batch 64] [--contexts 4096 8192 32768] [--json sweep.json]

Prints, per (KV format, context), every configuration's median ms and %HBM (the pool's bytes read over
time against --hbm-tbs), then the fastest, and the launcher's default for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from kvserve.attention.testing import make_batch, quantized_copy
from kvserve.kernels.paged_kv import paged_kv
from kvserve.kernels.triton.kv_formats import MXFP4_BLOCK_N
from kvserve.kernels.triton.paged_decode import paged_decode


def pool_bytes(view, meta, block_size: int) -> int:
    """Bytes of the blocks the batch references, every field of the pool (codes, scales) counted."""
    blocks = int(sum(-(-s // block_size) for s in meta.seq_lens_list))
    per_block = 0
    for t in (view.k_cache, view.v_cache, view.k_scale, view.v_scale):
        if t is not None:
            per_block += t[0].numel() * t.element_size()
    return blocks * per_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--kv", nargs="+", default=["dense", "fp8_e4m3", "mxfp4"])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("H", "H_KV", "D"))
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument(
        "--hbm-tbs", type=float, default=4.8, help="the datasheet bandwidth, TB/s (H200 4.8, H100 3.35)"
    )
    ap.add_argument("--check-args", action="store_true", help="parse and import, then stop (the CPU dry run)")
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args()
    if args.check_args:
        return print("arguments ok")
    import triton.testing

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h, h_kv, d = args.heads
    print(
        f"# {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    rows = []
    for ctx in args.contexts:
        query, dense, meta = make_batch(
            [(1, ctx)] * args.batch, h, h_kv, d, 16, torch.bfloat16, "shuffled", device="cuda"
        )
        for kv in args.kv:
            pool = dense if kv == "dense" else quantized_copy(dense, meta, kv, torch.bfloat16)
            view = paged_kv(pool, torch.bfloat16)
            assert view is not None, kv
            nbytes = pool_bytes(view, meta, 16)
            call = (query, view.k_cache, view.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)

            def run(**launch):
                return paged_decode(*call, max_seq_len=ctx, scale=d**-0.5, **view.extras(), **launch)  # noqa: B023

            reference = run()
            block_ns = [MXFP4_BLOCK_N] if kv == "mxfp4" else args.block_n
            natives = [False, True] if kv == "fp8_e4m3" else [None]
            default_ms = triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")
            found = []
            for per_sm, block_n, warps, native in itertools.product(
                args.programs_per_sm, block_ns, args.warps, natives
            ):
                launch = dict(target_programs=per_sm * sms, block_n=block_n, num_warps=warps)
                if native is not None:
                    launch["native_fp8_decode"] = native
                try:
                    out = run(**launch)
                    err = (out.float() - reference.float()).abs().max().item()
                    ms = triton.testing.do_bench(
                        lambda launch=launch: run(**launch), warmup=5, rep=40, return_mode="median"
                    )
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a finding
                    print(f"{kv:<9} {ctx:>6} {launch}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                row = dict(kv=kv, context=ctx, batch=args.batch, **launch, ms=ms, max_abs_diff=err,
                           hbm_pct=100 * nbytes / (ms * 1e-3) / (args.hbm_tbs * 1e12), default_ms=default_ms)  # fmt: skip
                rows.append(row)
                found.append(row)
                print(
                    f"{kv:<9} {ctx:>6} per_sm {per_sm:>2} block_n {block_n:>3} warps {warps} native {native!s:<5} "
                    f"{ms:7.3f} ms {row['hbm_pct']:5.1f} %HBM  (|diff| {err:.1e})",
                    flush=True,
                )
            if found:
                best = min(found, key=lambda r: r["ms"])
                print(
                    f"## best {kv} {ctx}: {best['ms']:.3f} ms ({best['hbm_pct']:.1f} %HBM) with "
                    f"{ {k: best[k] for k in ('target_programs', 'block_n', 'num_warps')} } "
                    f"{'native ' + str(best.get('native_fp8_decode')) if kv == 'fp8_e4m3' else ''}; "
                    f"default {default_ms:.3f} ms ({100 * nbytes / (default_ms * 1e-3) / (args.hbm_tbs * 1e12):.1f} %HBM)",
                    flush=True,
                )
            del pool
        del dense
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
