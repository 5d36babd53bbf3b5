"""Attention kernel benchmark: paged backends against torch SDPA over the same KV laid out contiguously.

CPU (default): cpu_paged vs F.scaled_dot_product_attention on [B, H_kv, S, D] tensors, decode (one
token per sequence), a chunked prefill (q_len new tokens on top of the context), a whole prompt
(every position a row) and content-reuse repair (rows at every 7th position: PositionalBackend vs
the masked SDPA call over a gathered copy it uses off the extension), for several block-table layouts. Prints one table with the ratio paged / SDPA (lower is better; 1.0 = parity).
GPU (--device cuda): the same cases for the triton and cuda backends, reported as ms, TFLOP/s and
GB/s of KV read.

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
from machine import describe

from kvserve.attention.base import AttentionMetadata, SeqRows
from kvserve.attention.positional import PositionalBackend
from kvserve.attention.registry import create_backend
from kvserve.attention.testing import make_batch, quantized_copy


def interleaved_ms(fns: list, reps: int, sync) -> list[float]:
    """Median ms of each fn, timed in alternation so that load from other processes hits all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
    return [sorted(ts)[len(ts) // 2] * 1e3 for ts in times]


def contiguous_kv(kv, meta, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's KV as [H_kv, S, D] contiguous tensors (the SDPA baseline's layout)."""
    seq_len = meta.seq_lens_list[i]
    k, v = kv.gather(meta.block_tables[i, : -(-seq_len // meta.block_size)].long())
    k = k.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1).contiguous()
    v = v.reshape(-1, kv.num_kv_heads, kv.head_dim)[:seq_len].transpose(0, 1).contiguous()
    return k, v


def sdpa_fn(query, kv, meta, scale):
    """SDPA over contiguous copies: one batched call for equal-length decode, else one per sequence."""
    ks, vs = zip(*(contiguous_kv(kv, meta, i) for i in range(meta.num_seqs)), strict=True)
    q_len, seq_len = meta.query_lens_list[0], meta.seq_lens_list[0]
    if q_len == 1:
        q = query.unsqueeze(2)  # [B, H, 1, D]
        k, v = torch.stack(ks), torch.stack(vs)  # [B, H_kv, S, D]
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos  # bottom-right causal
    qs = query.view(meta.num_seqs, q_len, *query.shape[1:]).transpose(1, 2)  # [B, H, q_len, D]

    def run():
        for b in range(meta.num_seqs):
            F.scaled_dot_product_attention(
                qs[b : b + 1], ks[b][None], vs[b][None], attn_mask=mask, scale=scale, enable_gqa=True
            )

    return run


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
    """(case, batch, context, layout): decode for every batch size, chunked prefill for batch 1."""
    out = []
    for case in args.cases:
        for batch in args.batches if case == "decode" else [1]:  # prefill, prompt: one sequence
            out += [(case, batch, ctx, layout) for ctx in args.contexts for layout in args.layouts]
    return out


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
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend_names = ["cpu_paged"] if device.type == "cpu" else ["triton", "cuda"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    h, h_kv, d = args.heads
    print(f"# {describe()}, {device}, {dtype}, H={h} H_kv={h_kv} D={d}")
    header = (
        f"{'case':<8} {'B':>2} {'ctx':>5} {'layout':<10} {'kv':<9} {'backend':<9} {'sdpa ms':>8} {'ms':>8} "
        f"{'ratio':>6}"
    )
    print(header + (f" {'TFLOP/s':>8} {'GB/s':>7}" if device.type == "cuda" else ""))
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
        runs = [(fmt, name) for fmt in pools for name in case_backends]
        fns += [
            functools.partial(case_backends[name].forward, query, pools[fmt], meta, scale)
            for fmt, name in runs
        ]
        base_ms, *times = interleaved_ms(fns, args.reps, sync)
        flops, kv_bytes = flops_and_bytes(meta, h, h_kv, d, query.element_size())
        for (fmt, name), ms in zip(runs, times, strict=True):
            row = dict(
                case=case, batch=batch, ctx=ctx, layout=layout, kv=fmt, backend=name, sdpa_ms=base_ms, ms=ms
            )
            row.update(ratio=ms / base_ms, tflops=flops / ms / 1e9, gbps=kv_bytes / ms / 1e6)
            rows.append(row)
            line = (
                f"{case:<8} {batch:>2} {ctx:>5} {layout:<10} {fmt:<9} {name:<9} {base_ms:>8.3f} {ms:>8.3f} "
                f"{ms / base_ms:>6.2f}"
            )
            if device.type == "cuda":
                line += f" {row['tflops']:>8.1f} {row['gbps']:>7.0f}"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
