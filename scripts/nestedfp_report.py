"""NestedFP, per linear weight of a model: is it in the FP8 view's range as it is, which power-of-two
pre-scales its rows need, and what each step costs against the checkpoint (the conversion to FP16,
and FP8 mode). Writes docs/weights.md between the nestedfp-layers markers.

    python scripts/nestedfp_report.py [--model smollm2-135m] [--doc docs/weights.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.checkpoint import checkpoint, linear_weights  # noqa: E402
from harness.docs import fill  # noqa: E402
from harness.machine import describe  # noqa: E402

from kvserve.quant.nestedfp import FP8_LIMIT, LayerReport, report  # noqa: E402


def render(
    model: str, dtype: str, rows: list[LayerReport], bf16: list[LayerReport], table: LayerReport
) -> str:
    params = sum(r.shape[0] * r.shape[1] for r in rows)
    channels = sum(r.shape[0] for r in rows)
    out_of_range = [r for r in rows if not r.in_range]
    fp8 = [r.fp8_rel_error for r in rows]
    lines = [
        f"Measured by `python scripts/nestedfp_report.py --model {model}` on {describe()}: "
        f"{len(rows)} linear weights, {params / 1e6:.1f} M parameters, checkpoint dtype {dtype}.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| weights with some \\|w\\| > {FP8_LIMIT} (the seed would keep them in 16 bits) "
        f"| {len(out_of_range)} of {len(rows)} |",
        f"| weights nested after the per-row pre-scale | {len(rows)} of {len(rows)} |",
        f"| row exponents (w x 2^e) | {min(r.exponent_min for r in rows)} to "
        f"{max(r.exponent_max for r in rows)} |",
        f"| bytes per parameter, both planes + one exponent byte per row | "
        f"{(2 * params + channels) / params:.4f} (FP8 mode reads {(params + channels) / params:.4f}) |",
        f"| conversion to FP16 (pre-scaled): max \\|error\\| | {max(r.fp16_max_abs_error for r in rows):.3g} |",
        f"| conversion to FP16: mean \\|error\\| (mean over weights) "
        f"| {statistics.fmean(r.fp16_mean_abs_error for r in rows):.3g} |",
        f"| overflow in plain FP16 (no pre-scale) | {sum(r.fp16_overflow for r in rows)} weights |",
        f"| the checkpoint cast to bf16 first, then converted: max / mean \\|error\\| against the bf16 weights "
        f"| {max(r.fp16_max_abs_error for r in bf16):.3g} / {statistics.fmean(r.fp16_mean_abs_error for r in bf16):.3g}"
        f" (overflow: {sum(r.fp16_overflow for r in bf16)} weights) |",
        f"| the embedding table, which the engine nests too (tied LM head, {table.shape[0]}x{table.shape[1]}): "
        f"FP16 max \\|error\\|, FP8 relative error | {table.fp16_max_abs_error:.3g}, {table.fp8_rel_error:.4f} |",
        f"| FP8 mode, relative error \\|\\|W8 - W\\|\\| / \\|\\|W\\|\\|: median / max "
        f"| {statistics.median(fp8):.4f} / {max(fp8):.4f} |",
        "",
        "<details><summary>Per layer</summary>",
        "",
        "| weight | shape | max \\|w\\| | in range as is | row exponents | FP16 max err | FP8 rel err |",
        "|---|---|---:|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.shape[0]}x{r.shape[1]} | {r.max_abs:.3f} | {'yes' if r.in_range else 'no'} "
            f"| {r.exponent_min}..{r.exponent_max} | {r.fp16_max_abs_error:.2e} | {r.fp8_rel_error:.4f} |"
        )
    lines += ["", "</details>"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "weights.md")
    args = ap.parse_args()
    weights = linear_weights(args.model)
    dtype = str(next(iter(weights.values())).dtype).replace("torch.", "")  # type: ignore[attr-defined]
    rows = [report(name, w) for name, w in weights.items()]  # type: ignore[arg-type]
    bf16 = [report(name, w.bfloat16()) for name, w in weights.items()]  # type: ignore[union-attr]
    table = report("model.embed_tokens.weight", checkpoint(args.model)["model.embed_tokens.weight"])
    text = render(args.model, dtype, rows, bf16, table)
    print(text)
    fill(args.doc, "nestedfp-layers", text)


if __name__ == "__main__":
    main()
