"""Prefix reuse on the default model: cold vs warm TTFT, cold TTFT vs Hugging Face, decode batching.

Measures, in one run, with trials interleaved to spread machine noise:
  cold TTFT     a 2,048-token prefix never seen before + a 64-token suffix (kvserve, cache on: a miss)
  warm TTFT     the same cached prefix + a new 64-token suffix
  suffix-only   the physical limit of reuse: HF forward of the 64 suffix tokens over the prefix's KV
                already in a DynamicCache (no lookup, no copying, nothing else)
  HF cold       transformers `generate(max_new_tokens=1)` on the same 2,112-token prompt
  decode        aggregate generated tokens/s with 8 concurrent requests vs 1

TTFT is measured from the moment the request is created (lookup and scheduling included).

    python scripts/bench_prefix_reuse.py [--trials 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from harness.machine import describe
from harness.texts import corpus_tokens

from kvserve import LLM, SamplingParams
from kvserve.request import Request


def kvserve_ttft(llm: LLM, prompt: list[int]) -> float:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert out.metrics.ttft_s is not None
    return out.metrics.ttft_s


@torch.inference_mode()
def hf_cold_ttft(hf: torch.nn.Module, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    hf.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_suffix_only(hf: torch.nn.Module, prefix: list[int], suffix: list[int], trials: int) -> list[float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    hf(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = hf(torch.tensor([suffix]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        times.append(time.perf_counter() - t0)
        cache.crop(-len(suffix))  # transformers 5: a negative count removes that many tokens
    return times


def decode_throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine = llm.engine
    ids = [f"dec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(Request(rid, p, params))
    # time only the decode phase: from when every request has its first token
    first_done = False
    t0 = 0.0
    remaining = set(ids)
    generated_after_t0 = 0
    while remaining:
        outs = engine.step()
        for out in outs:
            if first_done:
                generated_after_t0 += len(out.new_token_ids)
            if out.finished:
                remaining.discard(out.request_id)
        if not first_done and all(
            engine.scheduler.find(r) is None or engine.scheduler.find(r).output_token_ids for r in ids
        ):
            first_done, t0 = True, time.perf_counter()
    return generated_after_t0 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    llm = LLM(model=args.model, max_cache_bytes=2_000_000_000)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.info.model_path, dtype=torch.float32).eval()
    p_len, s_len = args.prefix_tokens, args.suffix_tokens
    shared = corpus_tokens(llm, p_len, seed=1000)
    # registers the shared prefix; also warms up
    kvserve_ttft(llm, shared + corpus_tokens(llm, s_len, seed=2000))

    cold, warm, hf_cold = [], [], []
    for t in range(args.trials):  # interleaved
        fresh_prefix = corpus_tokens(llm, p_len, seed=t + 1)
        suffix = corpus_tokens(llm, s_len, seed=3000 + t)
        cold.append(kvserve_ttft(llm, fresh_prefix + suffix))
        warm.append(kvserve_ttft(llm, shared + suffix))
        hf_cold.append(hf_cold_ttft(hf, fresh_prefix + suffix))
    limit = hf_suffix_only(hf, shared, corpus_tokens(llm, s_len, seed=4000), args.trials)

    short = [corpus_tokens(llm, 32, seed=5000 + i) for i in range(8)]
    tput_1 = decode_throughput(llm, short[:1], args.decode_tokens)
    tput_8 = decode_throughput(llm, short, args.decode_tokens)

    med = statistics.median
    rows = [
        ("cold TTFT (kvserve, miss)", f"{med(cold) * 1000:.0f} ms", ""),
        (
            "warm TTFT (kvserve, 2048 cached)",
            f"{med(warm) * 1000:.0f} ms",
            f"cold/warm = {med(cold) / med(warm):.1f}x (target >= 15x)",
        ),
        (
            "suffix-only prefill over cached KV (HF)",
            f"{med(limit) * 1000:.0f} ms",
            f"warm/limit = {med(warm) / med(limit):.2f}x (target <= 1.3x)",
        ),
        (
            "HF generate cold TTFT",
            f"{med(hf_cold) * 1000:.0f} ms",
            f"kvserve cold/HF = {med(cold) / med(hf_cold):.2f}x (target <= 1.1x)",
        ),
        ("decode tok/s, 1 request", f"{tput_1:.1f}", ""),
        ("decode tok/s, 8 concurrent", f"{tput_8:.1f}", f"8 vs 1 = {tput_8 / tput_1:.1f}x (target >= 4x)"),
    ]
    machine = describe()
    print(
        f"# bench_prefix_reuse: {args.model}, prefix {p_len} + suffix {s_len} tokens, {args.trials} trials (median); {machine}"
    )
    print(f"| {'measurement':<42} | {'value':>9} | ratio |")
    print(f"|{'-' * 44}|{'-' * 11}|-------|")
    for name, value, ratio in rows:
        print(f"| {name:<42} | {value:>9} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "cold_s": cold,
                    "warm_s": warm,
                    "suffix_only_s": limit,
                    "hf_cold_s": hf_cold,
                    "decode_tok_s_1": tput_1,
                    "decode_tok_s_8": tput_8,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
