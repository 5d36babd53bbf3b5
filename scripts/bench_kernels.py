"""Attention kernel benchmark: paged backends against torch SDPA over the same KV laid out contiguously.

CPU (default): cpu_paged vs F.scaled_dot_product_attention on [B, H_kv, S, D] tensors, decode (one
token per sequence), a chunked prefill (q_len new tokens on top of the context), a whole prompt
(every position a row) and content-reuse repair (rows at every 7th position: PositionalBackend vs
the masked SDPA call over a gathered copy it uses off the extension), for several block-table layouts. Prints one table with the ratio paged / SDPA (lower is better; 1.0 = parity).
GPU (--device cuda): the same cases for the triton and cuda backends, reported as ms, TFLOP/s, GB/s of
KV read (the pool's own bytes: codes, scales and zeros for quantized formats) and that as a share of
the datasheet HBM bandwidth and of a copy measured at start. A backend is timed over a quantized pool
only where it reads it in place (--all-paths also times dense copies). Whole prompts of equal length
compare against SDPA's flash backend, causal and batched (the FA2 prefill's baseline).

    python scripts/bench_kernels.py [--heads 32 8 128] [--contexts 2048 8192] [--json out.json]
    python scripts/bench_kernels.py --kv dense fp8_e4m3 int8 --cases decode   # quantized pools, in place
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F
from harness.machine import describe

from kvserve.attention.base import AttentionMetadata, SeqRows
from kvserve.attention.positional import PositionalBackend
from kvserve.attention.registry import create_backend
from kvserve.attention.testing import make_batch, quantized_copy


def interleaved_ms(fns: list, reps: int, sync, calls: int = 1) -> list[float]:
    """Median ms of each fn, timed in alternation so that load from other processes hits all alike.
    `calls` back-to-back calls between syncs per timing (GPU: 10), divided out: the host queues the next
    launch while the device runs, so a kernel shorter than its launcher's Python is not timed as the
    launcher (the first GPU run timed one call per sync: 0.53 ms for bf16 decode at 64 x 4k that
    triton.testing.do_bench put at 0.26 ms)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            ts.append((time.perf_counter() - t0) / calls)
    return [sorted(ts)[len(ts) // 2] * 1e3 for ts in times]


def contiguous_kv(kv, meta, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's KV as [H_kv, S, D] contiguous tensors (the SDPA baseline's layout)."""
    seq_len = meta.seq_lens_list[i]
    k, v = kv.gather(meta.block_tables[i, : -(-seq_len // meta.block_size)].long())
    k = k.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1).contiguous()
    v = v.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1).contiguous()
    return k, v


def sdpa_fn(query, kv, meta, scale):
    """SDPA over contiguous copies: one batched call for equal-length decode and, on GPUs, for whole
    prompts of equal length (causal, flash backend: the baseline the FA2 prefill is held to); else
    one masked call per sequence."""
    ks, vs = zip(*(contiguous_kv(kv, meta, i) for i in range(meta.num_seqs)), strict=True)
    q_len, seq_len = meta.query_lens_list[0], meta.seq_lens_list[0]
    if q_len == 1:
        q = query.unsqueeze(2)  # [B, H, 1, D]
        k, v = torch.stack(ks), torch.stack(vs)  # [B, H_kv, S, D]
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    whole = set(meta.query_lens_list) == {seq_len} and set(meta.seq_lens_list) == {seq_len}
    if whole and query.device.type == "cuda":
        return flash_sdpa_fn(query, torch.stack(ks), torch.stack(vs), meta.num_seqs, scale)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos  # bottom-right causal
    qs = query.view(meta.num_seqs, q_len, *query.shape[1:]).transpose(1, 2)  # [B, H, q_len, D]

    def run():
        for b in range(meta.num_seqs):
            F.scaled_dot_product_attention(
                qs[b : b + 1], ks[b][None], vs[b][None], attn_mask=mask, scale=scale, enable_gqa=True
            )

    return run


def flash_sdpa_fn(query, k, v, num_seqs: int, scale: float):
    """Causal SDPA on the flash backend over [B, H, S, D]; K and V are expanded to every query head
    first where the flash kernel takes no GQA (that copy is made once, outside the timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = query.view(num_seqs, -1, *query.shape[1:]).transpose(1, 2)  # [B, H, S, D]
    group = q.shape[1] // k.shape[1]

    def call(k, v, gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    try:
        call(k, v, True)
        return lambda: call(k, v, True)
    except RuntimeError:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        call(k, v, False)
        return lambda: call(k, v, False)


def in_place(backend: str, pool, dtype: torch.dtype) -> bool:
    """Whether `backend` reads `pool` where it lies (else it would time a dense copy first)."""
    from kvserve.kernels import cpu_ext
    from kvserve.kernels.cuda_ext import KV_FORMATS
    from kvserve.kernels.paged_kv import paged_kv

    view = paged_kv(pool, dtype)
    if view is None:
        return False
    if backend == "cuda":
        return view.kv_format in KV_FORMATS
    if backend == "cpu_paged":
        return cpu_ext.readable_pool(pool) is not None
    return True  # triton's decode reads every kernel view


def pool_bytes_per_token(pool) -> float:
    """Bytes one token's K and V take in the pool (codes, scales and zeros)."""
    return pool.bytes_per_block() / pool.block_size


def repair_rows(query: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """One whole-prompt sequence -> its rows at every 7th position and the last (about 15 %)."""
    seq_len = meta.seq_lens_list[0]
    positions = torch.cat([torch.arange(0, seq_len - 1, 7), torch.tensor([seq_len - 1])]).to(query.device)
    blocks = meta.block_tables[0, : -(-seq_len // meta.block_size)].tolist()
    sub = AttentionMetadata.build(
        [SeqRows(blocks, positions, seq_len)],
        meta.block_size,
        query.device,
        write=False,
        explicit_positions=True,
    )
    return query[positions].contiguous(), sub


def cases(args) -> list[tuple[str, int, int, str]]:
    """(case, batch, context, layout): decode for every batch size, whole prompts for --prompt-batch,
    chunked prefill and repair for batch 1."""
    out = []
    for case in args.cases:
        batches = {"decode": args.batches, "prompt": [args.prompt_batch]}.get(case, [1])
        for batch in batches:  # chunked prefill and repair: one sequence
            out += [(case, batch, ctx, layout) for ctx in args.contexts for layout in args.layouts]
    return out


def hbm_ceilings() -> dict:
    """The GPU's datasheet HBM bandwidth and its measured copy bandwidth (harness/gpu.py)."""
    from harness.gpu import ceilings, datasheet_tbps

    return {"datasheet_tbps": datasheet_tbps(torch.cuda.get_device_name()), **ceilings()}


def flops_and_bytes(meta, h, h_kv, d, elem) -> tuple[float, float]:
    flops = sum(4 * q * s * h * d for q, s in zip(meta.query_lens_list, meta.seq_lens_list, strict=True))
    kv_bytes = sum(2 * s * h_kv * d * elem for s in meta.seq_lens_list)
    return flops, kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("H", "H_KV", "D"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "mixed", "shuffled"])
    ap.add_argument("--prefill-q", type=int, default=256, help="new tokens in the chunked-prefill case")
    ap.add_argument("--prompt-batch", type=int, default=1, help="sequences in the whole-prompt case")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["decode", "prefill"],
        choices=["decode", "prefill", "prompt", "repair"],
    )
    ap.add_argument(
        "--kv",
        nargs="+",
        default=["dense"],
        help="pool formats the paged backends read: dense (the compute dtype) or a kv_cache_dtype "
        "such as bf16, fp8_e4m3, int8; SDPA always reads the dense KV",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument(
        "--all-paths",
        action="store_true",
        help="also time backends over pools they read through a dense copy (by default only in place)",
    )
    ap.add_argument(
        "--check-args",
        action="store_true",
        help="parse the arguments and import the GPU path, then stop (scripts/gpu/run.sh's CPU dry run)",
    )
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.check_args:
        import kvserve.attention.cuda_backend  # noqa: F401
        import kvserve.attention.triton_backend  # noqa: F401
        import kvserve.kernels.triton.paged_decode  # noqa: F401
        import kvserve.kernels.triton.paged_prefill  # noqa: F401

        return print("arguments ok")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend_names = ["cpu_paged"] if device.type == "cpu" else ["triton", "cuda"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    h, h_kv, d = args.heads
    where = describe() if device.type == "cpu" else f"{torch.cuda.get_device_name()}; host {describe()}"
    print(f"# {where}, {device}, {dtype}, H={h} H_kv={h_kv} D={d}")
    hbm = hbm_ceilings() if device.type == "cuda" else {}
    if hbm:
        print(f"# HBM: datasheet {hbm['datasheet_tbps']} TB/s, measured copy {hbm['copy_tbps']:.2f} TB/s")
    header = (
        f"{'case':<8} {'B':>2} {'ctx':>5} {'layout':<10} {'kv':<9} {'backend':<9} {'sdpa ms':>8} {'ms':>8} "
        f"{'ratio':>6}"
    )
    print(header + (f" {'TFLOP/s':>8} {'GB/s':>7} {'%HBM':>5} {'%copy':>5}" if device.type == "cuda" else ""))
    backends = {}
    for name in backend_names:
        try:
            backends[name] = create_backend(name, device)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"# {name}: {exc}")
    rows = []
    for case, batch, ctx, layout in cases(args):
        q_len = {"decode": 1, "prefill": args.prefill_q}.get(case, ctx)
        lens = [(q_len, ctx)] * batch
        query, kv, meta = make_batch(lens, h, h_kv, d, args.block_size, dtype, layout, device=args.device)
        scale = d**-0.5
        pools = {fmt: kv if fmt == "dense" else quantized_copy(kv, meta, fmt, dtype) for fmt in args.kv}
        case_backends = backends
        if case == "repair":
            query, meta = repair_rows(query, meta)
            case_backends = {"positional": PositionalBackend()}
            fns = [functools.partial(PositionalBackend(use_extension=False).forward, query, kv, meta, scale)]
        else:
            fns = [sdpa_fn(query, kv, meta, scale)]
        runs = [
            (fmt, name)
            for fmt in pools
            for name in case_backends
            if fmt == "dense" or args.all_paths or case == "repair" or in_place(name, pools[fmt], dtype)
        ]
        fns += [
            functools.partial(case_backends[name].forward, query, pools[fmt], meta, scale)
            for fmt, name in runs
        ]
        base_ms, *times = interleaved_ms(fns, args.reps, sync, calls=10 if device.type == "cuda" else 1)
        flops, dense_bytes = flops_and_bytes(meta, h, h_kv, d, query.element_size())
        for (fmt, name), ms in zip(runs, times, strict=True):
            # bytes of the pool itself: codes plus scales for the quantized formats
            kv_bytes = dense_bytes * pool_bytes_per_token(pools[fmt]) / pool_bytes_per_token(kv)
            row = dict(
                case=case, batch=batch, ctx=ctx, layout=layout, kv=fmt, backend=name, sdpa_ms=base_ms, ms=ms
            )
            row.update(ratio=ms / base_ms, tflops=flops / ms / 1e9, gbps=kv_bytes / ms / 1e6)
            row.update(kv_bytes=kv_bytes, bytes_x_dense=kv_bytes / dense_bytes)
            if hbm:
                row.update(pct_hbm=100 * row["gbps"] / 1e3 / (hbm["datasheet_tbps"] or float("nan")))
                row.update(pct_copy=100 * row["gbps"] / 1e3 / hbm["copy_tbps"])
            rows.append(row)
            line = (
                f"{case:<8} {batch:>2} {ctx:>5} {layout:<10} {fmt:<9} {name:<9} {base_ms:>8.3f} {ms:>8.3f} "
                f"{ms / base_ms:>6.2f}"
            )
            if device.type == "cuda":
                line += f" {row['tflops']:>8.1f} {row['gbps']:>7.0f} {row['pct_hbm']:>5.1f} {row['pct_copy']:>5.1f}"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
