"""Engine benchmark on a GPU: a random-weight model of a real shape (default Llama-3.1-8B, bf16) served by
kvserve's engine, per attention backend and KV format. One table, then JSON.

- parity: the logprobs each GPU backend gives, prefill (prompt_logprobs, 5 alternatives per position)
  and decode (each generated token's logprob), against the torch reference backend's prefill over the
  same tokens: the largest |difference| and the share of positions whose best token agrees.
- TTFT of a 2k-token prompt, cold (nothing cached) and warm (the same prompt again: prefix hit).
- decode tokens/s at batch 1 and 32: batch / the median time between a request's tokens.
- KV capacity: tokens the pool holds at the same --max-cache-gib, per KV format, and the ratio to bf16.

    python scripts/gpu/bench_engine.py --model .gpu-bundle/models/llama-3.1-8b [--json engine.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the harness
from kvserve import LLM, SamplingParams  # noqa: E402


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def build(args, backend: str, kv: str) -> LLM:
    return LLM(
        model=args.model,
        device=args.device,
        dtype="bfloat16",
        attention_backend=backend,
        kv_cache_dtype=kv,
        max_cache_bytes=int(args.max_cache_gib * 2**30),
        max_num_seqs=max(args.decode_batches),
        max_num_batched_tokens=max(args.prompt_len, 2048),
    )


def free(llm: LLM) -> None:
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


PARITY_PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)


def parity_run(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: the backend's prompt logprobs and its greedy tokens with their logprobs."""
    outs = [llm.generate([p], PARITY_PARAMS)[0] for p in prompts]
    return [
        {
            "prompt": [(lp.token_id, lp.logprob, lp.top[0][0]) for lp in o.prompt_logprobs[1:]],
            "tokens": o.token_ids,
            "decode": [lp.logprob for lp in o.logprobs],
        }
        for o in outs
    ]


def parity_compare(reference: LLM, prompts: list[list[int]], runs: list[dict]) -> dict:
    """The reference's prefill over prompt + the backend's tokens scores both of the backend's paths."""
    ref_params = SamplingParams(max_tokens=0, prompt_logprobs=5)
    prefill_diff, decode_diff, agree, total = 0.0, 0.0, 0, 0
    for prompt, run in zip(prompts, runs, strict=True):
        ref = reference.generate([prompt + run["tokens"]], ref_params)[0].prompt_logprobs[1:]
        for (token, logprob, best), r in zip(run["prompt"], ref[: len(prompt) - 1], strict=True):
            assert r.token_id == token
            prefill_diff = max(prefill_diff, abs(logprob - r.logprob))
            agree += best == r.top[0][0]
            total += 1
        for logprob, r in zip(run["decode"], ref[len(prompt) - 1 :], strict=True):
            decode_diff = max(decode_diff, abs(logprob - r.logprob))
    return {
        "max_prefill_logprob_diff": prefill_diff,
        "max_decode_logprob_diff": decode_diff,
        "top1_agree": agree / total,
    }


def ttft(llm: LLM, prompts: list[list[int]]) -> tuple[float, float, int]:
    """(median cold TTFT, median warm TTFT, cached tokens of the warm requests) over `prompts`."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cold = [llm.generate([p], one)[0] for p in prompts]
    warm = [llm.generate([p], one)[0] for p in prompts]
    return (
        statistics.median(o.metrics.ttft_s for o in cold),
        statistics.median(o.metrics.ttft_s for o in warm),
        min(o.num_cached_tokens for o in warm),
    )


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(tokens/s over the batch, median seconds between a request's tokens) for len(prompts) at once."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    itl = statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / tokens for o in outs)
    return len(prompts) / itl, itl


def gpu_busy(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """A decode call under the profiler: the share of its wall time the GPU spent in kernels (far below
    1 means the step waits on the host: Python, launches) and the kernels that took most of it."""
    return {"batch": len(prompts), **profiled(lambda: decode_rate(llm, prompts, tokens))}


def prefill_profile(llm: LLM, prompt: list[int]) -> dict:
    """One cold request of `prompt` (one token out) under the profiler: where its TTFT goes."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return profiled(lambda: llm.generate([prompt], one), top=6)


def profiled(fn, top: int = 3) -> dict:
    """fn() under torch.profiler: wall time, the GPU's busy share of it, the `top` kernels by device
    time, and the `top` host operators by self CPU time with their call counts (where a host-bound
    step spends its time). A diagnostic: if the profiler fails, {"error": ...} and the benchmark's
    figures stand."""
    try:
        return _profiled(fn, top)
    except Exception as exc:  # noqa: BLE001 - report it and keep the benchmark's figures
        return {"error": repr(exc)[:200]}


def _profiled(fn, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    events = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    host = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]
    device_us = sum(e.self_device_time_total for e in events)
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    ops = sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "wall_s": wall,
        "gpu_busy": device_us / 1e6 / wall,
        "top_kernels": [(e.key[:60], round(e.self_device_time_total / 1e3, 2)) for e in kernels],
        "top_host_ops": [(e.key[:60], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in ops],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory or name (random:llama-3.1-8b)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", nargs="+", default=["triton", "cuda"])
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3"], help="kv_cache_dtype names; bf16 first")
    ap.add_argument("--prompt-len", type=int, default=2048, help="the TTFT prompt")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--parity-lens", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--max-cache-gib", type=float, default=20.0)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="GPU busy share")
    ap.add_argument(
        "--check-args",
        action="store_true",
        help="parse the arguments and import the GPU path, then stop (scripts/gpu/run.sh's CPU dry run)",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.check_args:
        return print("arguments ok")  # the engine (kvserve.LLM) is imported at the top
    from harness.machine import describe

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"# {device_name}; host {describe()}; model {args.model}")
    rows, parity_runs = [], {}
    vocab = None
    for backend in args.backends:
        for kv in args.kv:
            started = time.perf_counter()
            llm = build(args, backend, kv)
            info = llm.engine.info
            vocab = info.vocab_size
            build_s = time.perf_counter() - started
            parity_prompts = [random_prompts(1, n, vocab, seed=n)[0] for n in args.parity_lens]
            if kv == args.kv[0]:
                parity_runs[backend] = parity_run(llm, parity_prompts)
            llm.generate(random_prompts(1, args.prompt_len, vocab, seed=99), SamplingParams(max_tokens=2))
            cold, warm, cached = ttft(llm, random_prompts(args.ttft_reps, args.prompt_len, vocab, seed=1))
            profile_ttft = (
                prefill_profile(llm, random_prompts(1, args.prompt_len, vocab, seed=7)[0])
                if args.profile and backend == args.backends[0]
                else None
            )
            row = dict(
                backend=backend, kv=kv, attention_backend=info.attention_backend, kv_codec=info.kv_codec,
                pool_tokens=info.pool_tokens, bytes_per_token=info.bytes_per_token, build_s=build_s,
                ttft_cold_s=cold, ttft_warm_s=warm, warm_cached_tokens=cached, profile_ttft=profile_ttft,
            )  # fmt: skip
            for i, batch in enumerate(args.decode_batches):
                prompts = random_prompts(batch, args.decode_prompt_len, vocab, seed=1000 + i)
                decode_rate(llm, prompts[:1], 2)  # compiles this batch's kernels outside the timing
                rate, itl = decode_rate(llm, prompts, args.decode_tokens)
                row[f"decode_tok_s_b{batch}"], row[f"itl_ms_b{batch}"] = rate, itl * 1e3
                if args.profile and backend == args.backends[0] and batch == args.decode_batches[0]:
                    row[f"profile_b{batch}"] = gpu_busy(llm, prompts, args.decode_tokens // 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            free(llm)
    reference = build(args, "reference", args.kv[0])
    parity_prompts = [random_prompts(1, n, vocab, seed=n)[0] for n in args.parity_lens]
    parity = {b: parity_compare(reference, parity_prompts, runs) for b, runs in parity_runs.items()}
    free(reference)
    base = {r["backend"]: r for r in rows if r["kv"] == args.kv[0]}
    for r in rows:
        r["capacity_x_bf16"] = r["pool_tokens"] / base[r["backend"]]["pool_tokens"]
        r["ttft_cold_x_bf16"] = r["ttft_cold_s"] / base[r["backend"]]["ttft_cold_s"]
    print(f"\n# engine, {device_name}, {args.model}, bf16 weights, prompt {args.prompt_len} tokens")
    head = f"{'backend':<8} {'kv':<9} {'pool tok':>9} {'cap x':>6} {'TTFT cold':>9} {'x bf16':>6} {'TTFT warm':>9}"
    head += "".join(f" {'tok/s b' + str(b):>10}" for b in args.decode_batches)
    print(head)
    for r in rows:
        line = (
            f"{r['backend']:<8} {r['kv']:<9} {r['pool_tokens']:>9} {r['capacity_x_bf16']:>6.2f} "
            f"{r['ttft_cold_s'] * 1e3:>7.1f}ms {r['ttft_cold_x_bf16']:>6.3f} {r['ttft_warm_s'] * 1e3:>7.1f}ms"
        )
        line += "".join(f" {r[f'decode_tok_s_b{b}']:>10.1f}" for b in args.decode_batches)
        print(line)
    for r in rows:
        for what, p in [(f"decode b{b}", r.get(f"profile_b{b}")) for b in args.decode_batches] + [
            ("cold prefill", r.get("profile_ttft"))
        ]:
            if p and "error" not in p:
                print(
                    f"# {what} ({r['backend']}, {r['kv']}): {p['wall_s'] * 1e3:.1f} ms, GPU busy {p['gpu_busy']:.0%} "
                    f"of it; top kernels (name, ms): {p['top_kernels']}; top host ops (name, ms, calls): "
                    f"{p.get('top_host_ops')}"
                )
            elif p:
                print(f"# {what} ({r['backend']}, {r['kv']}): profiler failed: {p['error']}")
    print(
        f"\n# parity against the reference backend (bf16, prompts of {args.parity_lens} tokens + 16 greedy)"
    )
    for backend, p in parity.items():
        print(
            f"{backend:<8} max |d logprob| prefill {p['max_prefill_logprob_diff']:.4f} "
            f"decode {p['max_decode_logprob_diff']:.4f}; top-1 agreement {p['top1_agree']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device_name, "model": args.model, "rows": rows, "parity": parity}, f, indent=1
            )


if __name__ == "__main__":
    main()
