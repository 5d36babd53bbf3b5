"""KV memory of a long context on a model with sliding-window layers (issue 35): the pool blocks one
request holds, measured while it runs, against a layout where every layer keeps every token.

    python scripts/bench_window_memory.py --model gemma3-270m --tokens 8192

The request (one prompt of --tokens tokens of English text, a few greedy tokens) runs with prefix
caching off, so the pool holds only what it holds. After every step the script reads the request's
block tables (KVCacheManager.block_tables): the blocks it holds per layer group, the bytes those
take, and the bytes per token of context. The prefill computes --step rows a step; a sliding group
holds the window plus that step's rows meanwhile, so the peak is reported beside the decode figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.machine import describe  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402


def corpus(llm: LLM, n: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    assert len(ids) >= n, f"the corpus has {len(ids)} tokens"
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--step", type=int, default=512, help="max_num_batched_tokens: prefill rows a step")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    llm = LLM(
        model=args.model,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.step,
        max_model_len=args.tokens + args.max_tokens + 16,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.engine
    info, kv = engine.info, engine.kv
    layout = kv.layout
    assert layout is not None
    layer_block_bytes = info.bytes_per_token * info.block_size / info.num_layers  # one layer, one block
    block_bytes = layer_block_bytes * layout.num_slots
    steps: list[dict] = []
    slide = kv.slide

    def record(request_id: str, num_computed: int) -> None:
        slide(request_id, num_computed)
        tables = kv.block_tables(request_id)
        held = [sum(b >= 0 for b in t) for t in tables]
        steps.append(
            {"num_computed": num_computed, "blocks_per_group": held, "bytes": sum(held) * block_bytes}
        )

    kv.slide = record  # type: ignore[method-assign]
    prompt = corpus(llm, args.tokens)
    start = time.perf_counter()
    (out,) = llm.generate(
        [prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    )
    seconds = time.perf_counter() - start
    last = steps[-1]
    peak = max(steps, key=lambda s: s["bytes"])
    full = info.bytes_per_token
    result = {
        "model": args.model,
        "machine": describe(),
        "dtype": info.dtype,
        "kv_codec": info.kv_codec,
        "layout": info.kv_layout,
        "block_size": info.block_size,
        "step_tokens": args.step,
        "context_tokens": last["num_computed"],
        "full_layout_bytes_per_token": full,
        "held_bytes_per_token": last["bytes"] / last["num_computed"],
        "held_blocks_per_group": last["blocks_per_group"],
        "peak_bytes_per_token": peak["bytes"] / peak["num_computed"],
        "peak_at_tokens": peak["num_computed"],
        "predicted_held_blocks": layout.held_blocks(last["num_computed"], info.block_size),
        "seconds": seconds,
        "generated": out.token_ids,
    }
    assert sum(last["blocks_per_group"]) == result["predicted_held_blocks"]
    print(f"{args.model}: {info.kv_layout}; {info.dtype}, KV {info.kv_codec}; {describe()}")
    print(
        f"one request, {result['context_tokens']} tokens of context, {args.step}-row prefill steps, {seconds:.1f} s"
    )
    print()
    print("| layout | bytes / token | x full |")
    print("|---|---|---|")
    print(f"| every layer keeps every token | {full:,.0f} | 1.00 |")
    held = result["held_bytes_per_token"]
    print(f"| sliding layers keep their window (while it decodes) | {held:,.0f} | {held / full:.2f} |")
    pk = result["peak_bytes_per_token"]
    print(
        f"| the same, peak (during prefill, at {result['peak_at_tokens']} tokens) | {pk:,.0f} | {pk / full:.2f} |"
    )
    print()
    print(
        f"blocks held per layer group at the end: {last['blocks_per_group']} ({block_bytes:,.0f} bytes a block)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
