"""The bf16 linear kernels side by side: row_linear_bf16 on AMX tiles (where the CPU has them), the same
kernel on its AVX-512 lanes (`set_amx(False)`), and torch's bf16 linear (oneDNN), over the
projections of the default and the Qwen model at decode and prefill row counts. Median of repeated
calls, GFLOP/s; the ratios are within one run.

`--codes`: the fp32 path over GGUF codes instead: row_linear_codes (int8 codes, fp32 factors per group
of 16, as a model mixing Q6_K's 16 with 32 packs them today) against row_linear_qcodes (codes at their
own width, compact factors) over random codes of each projection's format in Qwen2.5-0.5B Q4_K_M and
SmolLM2 Q4_1, with the bytes each reads per weight and the GB/s that makes.

    python scripts/bench_linear.py [--rows 1 8 256 1800] [--threads 2] [--json out.json]
    python scripts/bench_linear.py --codes [--rows 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from harness.machine import describe, machine

from kvserve.kernels import cpu_ext
from kvserve.models.code_layout import choose_layout, pack
from kvserve.models.gguf_blocks import random_blocks
from kvserve.models.gguf_codes import codes_from_gguf, regroup

# (name, in_features, out_features)
SHAPES = [
    ("smollm2 gate+up", 576, 3072),
    ("qwen2.5-0.5b qkv", 896, 1152),
    ("qwen2.5-0.5b gate+up", 896, 9728),
    ("qwen2.5-0.5b down", 4864, 896),
]


def seconds(fn, budget: float = 0.6) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_paths(ext, x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, amx: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds of torch's linear, our AVX-512 lanes and (where it runs) our AMX tiles."""
    out = w.shape[0]
    t = {"torch": seconds(lambda: F.linear(x, w))}
    before = ext.set_amx(False)
    t["lanes"] = seconds(lambda: ext.row_linear_bf16(x, packed, None, out))
    ext.set_amx(before)
    if amx:
        t["amx"] = seconds(lambda: ext.row_linear_bf16(x, packed, None, out))
    return t


def cell(s: float, flops: int) -> str:
    return f"{s * 1e3:.3f} ms ({flops / s / 1e9:.0f} GF/s)"


# (name, GGUF type, in_features, out_features, gated): Qwen2.5-0.5B Q4_K_M's and SmolLM2-135M Q4_1's
CODE_SHAPES = [
    ("qwen q|k|v Q5_0", "Q5_0", 896, 1152, False),
    ("qwen gate|up Q5_0 (glu)", "Q5_0", 896, 9728, True),
    ("qwen down Q6_K", "Q6_K", 4864, 896, False),
    ("qwen down Q4_K", "Q4_K", 4864, 896, False),
    ("qwen lm_head Q8_0", "Q8_0", 896, 151936, False),
    ("smollm2 gate|up Q4_1 (glu)", "Q4_1", 576, 3072, True),
    ("smollm2 lm_head Q8_0", "Q8_0", 576, 49152, False),
]


def bench_codes(ext, rows_list: list[int]) -> list[dict]:  # type: ignore[no-untyped-def]
    """row_linear_codes (group 16, today's packing of a model with Q6_K) vs row_linear_qcodes."""
    from gguf import GGMLQuantizationType as QT

    lanes = ext.linear_lanes()
    print(
        "| projection | rows | int8 codes: B/w, ms, GB/s | packed codes: B/w, ms, GB/s | int8 time / packed |"
    )
    print("|---|---|---|---|---|")
    results = []
    for name, qtype, fin, fout, gated in CODE_SHAPES:
        c = codes_from_gguf(random_blocks(QT[qtype], fout, fin), QT[qtype])
        g16 = regroup(c, 16)
        old = ext.pack_linear_codes(g16.codes, g16.scale, g16.offset)
        layout = choose_layout([c])
        new = pack(ext, c, layout)
        packs = {"int8": (old, ext.row_linear_glu, ext.row_linear_codes),
                 "packed": (new, ext.row_linear_glu_qcodes, ext.row_linear_qcodes)}  # fmt: skip
        for rows in rows_list:
            x = torch.randn(rows, fin)
            cells, t = [], {}
            for key, (packed, glu, plain) in packs.items():
                if gated:
                    t[key] = seconds(lambda: glu(x, packed, None, fout // 2))  # noqa: B023
                else:
                    t[key] = seconds(lambda: plain(x, packed, None, fout))  # noqa: B023
                per_weight = packed.shape[1] / (fin * lanes)
                gbs = packed.numel() / t[key] / 1e9
                cells.append(f"{per_weight:.3f}, {t[key] * 1e3:.3f}, {gbs:.1f}")
            print(f"| {name} | {rows} | " + " | ".join(cells) + f" | {t['int8'] / t['packed']:.2f} |")
            results.append(
                {
                    "projection": name,
                    "layout": layout.describe(),
                    "rows": rows,
                    "seconds": t,
                    "bytes": {"int8": old.numel(), "packed": new.numel()},
                }  # fmt: skip
            )
    return results


def qwen_decoder_packs(ext, layers: int = 24) -> tuple[list[tuple], list[tuple]]:  # type: ignore[no-untyped-def]
    """Qwen2.5-0.5B Q4_K_M's projections and LM head, random codes of each one's GGUF type, packed both
    ways: (int8 calls, packed calls), each a list of (kernel, packed, in, out or inter). v is Q8_0 in
    every other layer (q|k|v then packs at 8 bits) and down alternates Q6_K and Q4_K, as in the file."""
    from gguf import GGMLQuantizationType as QT

    def codes(qtype: str, fin: int, fout: int, seed: int):  # type: ignore[no-untyped-def]
        return codes_from_gguf(random_blocks(QT[qtype], fout, fin, seed), QT[qtype])

    qk, v5, v8 = codes("Q5_0", 896, 1024, 1), codes("Q5_0", 896, 128, 2), codes("Q8_0", 896, 128, 3)
    o, gu = codes("Q5_0", 896, 896, 4), codes("Q5_0", 896, 9728, 5)
    down = [codes("Q6_K", 4864, 896, 6), codes("Q4_K", 4864, 896, 7)]
    old_calls, new_calls = [], []

    def add(parts: list, glu: bool) -> None:  # type: ignore[type-arg]
        fin, fout = parts[0].codes.shape[1], sum(c.codes.shape[0] for c in parts)
        n = fout // 2 if glu else fout
        layout = choose_layout(parts)
        new = torch.cat([pack(ext, c, layout) for c in parts])
        new_calls.append((ext.row_linear_glu_qcodes if glu else ext.row_linear_qcodes, new, fin, n))
        old = torch.cat(
            [ext.pack_linear_codes(c.codes, c.scale, c.offset) for c in (regroup(c, 16) for c in parts)]
        )
        old_calls.append((ext.row_linear_glu if glu else ext.row_linear_codes, old, fin, n))

    for i in range(layers):
        add([qk, v8 if i % 2 else v5], False)
        add([o], False)
        add([gu], True)
        add([down[i % 2]], False)
    add([codes("Q8_0", 896, 151936, 8)], False)
    return old_calls, new_calls


def bench_model_pass(ext, rows_list: list[int]) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every projection of Qwen2.5-0.5B and its LM head in turn (a decode step's linears, no attention),
    over the whole model's weights: past a CPU's cache, as the model is."""
    old_calls, new_calls = qwen_decoder_packs(ext)
    weights = sum(fin * packed.shape[0] * ext.linear_lanes() for _, packed, fin, _ in new_calls)
    xs = {n: torch.randn(max(rows_list), n) for n in (896, 4864)}

    def run(calls: list, rows: int) -> None:  # type: ignore[type-arg]
        for kernel, packed, fin, n in calls:
            kernel(xs[fin][:rows], packed, None, n)

    print(
        f"\n| Qwen2.5-0.5B's linears, one pass ({weights / 1e6:.0f}M weights) | rows | int8 codes | packed codes | int8 time / packed |"
    )
    print("|---|---|---|---|---|")
    results = []
    packs = (("int8", old_calls), ("packed", new_calls))
    for rows in rows_list:
        t: dict[str, float] = {}
        for _ in range(3):  # alternating rounds, the best median of each: cores shared with other work
            for key, calls in packs:
                t[key] = min(t.get(key, 1e9), seconds(lambda: run(calls, rows), budget=1.0))  # noqa: B023
        cells = []
        for key, calls in packs:
            nbytes = sum(packed.numel() for _, packed, _, _ in calls)
            cells.append(
                f"{t[key] * 1e3:.1f} ms, {nbytes / weights:.3f} B/w, {nbytes / t[key] / 1e9:.1f} GB/s"
            )
        print(f"| pass | {rows} | " + " | ".join(cells) + f" | {t['int8'] / t['packed']:.2f} |")
        results.append({"pass": "qwen2.5-0.5b linears", "rows": rows, "seconds": t})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--codes", action="store_true", help="the fp32 linears over GGUF codes")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    if args.codes:
        print(f"# bench_linear --codes: {describe()}, capability {cpu_ext.cpu_capability()}")
        results = bench_codes(ext, args.rows or [1, 8, 64])
        results += bench_model_pass(ext, args.rows or [1, 8, 64])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "describe": describe(), "results": results}, f, indent=1)
        return
    args.rows = args.rows or [1, 8, 256, 1800]
    amx = ext.linear_amx(SHAPES[0][1])
    rows_out = []
    print(f"# bench_linear: {describe()}")
    print(
        "| projection | rows | "
        + ("AMX tiles | " if amx else "")
        + "AVX-512 lanes | torch bf16 | torch time / ours |"
    )
    print("|---|---|" + ("---|" if amx else "") + "---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, fin, fout in SHAPES:
        w = (torch.randn(fout, fin, generator=gen) * 0.05).bfloat16()
        packed = ext.pack_linear_weight_bf16(w)
        for rows in args.rows:
            x = torch.randn(rows, fin, generator=gen).bfloat16()
            t = time_paths(ext, x, w, packed, amx)
            ours = t["amx"] if amx else t["lanes"]
            flops = 2 * rows * fin * fout
            cells = [cell(t[k], flops) for k in ("amx", "lanes", "torch") if k in t]
            print(f"| {name} | {rows} | " + " | ".join(cells) + f" | {t['torch'] / ours:.2f} |")
            rows_out.append({"projection": name, "in": fin, "out": fout, "rows": rows, "seconds": t})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine(), "describe": describe(), "amx": amx, "results": rows_out}, f, indent=1
            )


if __name__ == "__main__":
    main()
