"""Decode speed under KV codecs attention cannot read in place, with and without kept decoded blocks
(--kv-decoded-bytes), side by side in one run: the same prompts served at once, cache off, each codec
twice (decoding every block every step, then keeping decoded blocks across steps). Reports the decode
speed per sequence (one over the median time of the steps after every prompt's prefill, each of which
decodes one token of every sequence), the ratio, and whether the tokens are the same. bf16 (read
in place) is the yardstick. Engines run one after another, so the ratios are within one run.

    python scripts/bench_decoded_blocks.py [--model smollm2-135m] [--codecs bf16,int4dq,...]
        [--batch 8] [--prompt-tokens 650] [--max-tokens 32] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from harness.machine import describe

from kvserve import LLM, SamplingParams
from kvserve.request import Request

KEPT_BYTES = 256 << 20


def prompts_of(llm: LLM, batch: int, tokens: int) -> list[list[int]]:
    """`batch` different prompts of `tokens` tokens each, cut from Python's bundled docs."""
    from pydoc_data.topics import topics

    ids = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    assert len(ids) >= batch * tokens, "the corpus is shorter than the prompts asked for"
    return [ids[i * tokens : (i + 1) * tokens] for i in range(batch)]


def run(
    model: str, codec: str, kept: int, batch: int, prompt_tokens: int, max_tokens: int, dtype: str
) -> dict:
    """Serve `batch` prompts at once; time the steps after every prompt has its first token (pure
    decode steps: one token for each sequence)."""
    llm = LLM(
        model=model,
        enable_prefix_caching=False,
        kv_cache_dtype=codec,
        max_cache_bytes=500_000_000 + kept,
        kv_decoded_bytes=kept,
        dtype=dtype,
    )
    prompts = prompts_of(llm, batch, prompt_tokens)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_requests(Request(f"r{i}", list(p), params) for i, p in enumerate(prompts))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
    decode_steps: list[float] = []
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())  # every sequence past its prefill: this step decodes only
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == batch:
            decode_steps.append(time.perf_counter() - t0)
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
    stats = engine.stats()
    return {
        "codec": codec,
        "kept_bytes": kept,
        "decode_step_ms": statistics.median(decode_steps) * 1e3,
        "decode_tps": 1 / statistics.median(decode_steps),
        "tokens": list(tokens.values()),
        "decoded_mib": stats.decoded_bytes / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--codecs", default="bf16,int4dq,kint3-vturbo3,kint3dq-vturbo2,turbo3,nvfp4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=650)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype, pinned (auto times it at start-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    header = (
        f"{args.model}; {describe()}; {args.batch} prompts of {args.prompt_tokens} tokens at once, "
        f"{args.max_tokens} tokens each, cache off, compute {args.dtype}"
    )
    print(f"## {header}\n")
    print(
        "| codec | decode tok/s per sequence, decoding every block | with kept decoded blocks | ratio | kept MiB | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    for codec in args.codecs.split(","):
        fresh = run(args.model, codec, 0, args.batch, args.prompt_tokens, args.max_tokens, args.dtype)
        kept = run(args.model, codec, KEPT_BYTES, args.batch, args.prompt_tokens, args.max_tokens, args.dtype)
        same = fresh["tokens"] == kept["tokens"]
        ratio = kept["decode_tps"] / fresh["decode_tps"]
        print(
            f"| {codec} | {fresh['decode_tps']:.1f} | {kept['decode_tps']:.1f} | {ratio:.2f} | "
            f"{kept['decoded_mib']:.0f} | {'yes' if same else 'NO'} |",
            flush=True,
        )
        rows += [{k: v for k, v in r.items() if k != "tokens"} | {"same_tokens": same} for r in (fresh, kept)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
