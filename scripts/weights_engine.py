"""One weight format of the served model, measured end to end through the engine in this process:
resident weight bytes, single-stream and 8-way decode, perplexity. bench_weights.py --part engine runs
it once per format and round, each in its own process so that its memory is its own
(harness/weights_engine.py, which also holds the formats and renders the table).

    python scripts/weights_engine.py worker --format "nested fp8"    # one format, prints JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.weights_engine import BATCH, BATCH_TOKENS, DECODE_TOKENS, FORMATS, PPL_TOKENS, PPL_TOPICS  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def perplexity(llm: Any) -> float:
    """exp(mean NLL) of PPL_TOPICS' first PPL_TOKENS tokens each, as the server scores prompts."""
    from pydoc_data.topics import topics

    from kvserve import SamplingParams

    prompts = [llm.tokenizer.encode(topics[t])[:PPL_TOKENS] for t in PPL_TOPICS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll = [-e.logprob for o in outs for e in (o.prompt_logprobs or []) if e is not None]
    return math.exp(sum(nll) / len(nll))


def decode_rate(llm: Any, batch: int, tokens: int, seed: int) -> float:
    """Generated tokens per second after the last first token, `batch` requests of short prompts."""
    from kvserve import SamplingParams

    prompts = [
        [{"role": "user", "content": f"Story {seed}-{i}: write about a lighthouse keeper."}]
        for i in range(batch)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (end - start)


def worker(name: str, repeats: int) -> dict[str, Any]:
    from kvserve import LLM

    started = time.perf_counter()
    llm = LLM(model="smollm2-135m", enable_prefix_caching=False, max_cache_bytes=300_000_000, **FORMATS[name])
    load_s = time.perf_counter() - started
    info = llm.engine.info
    decode_rate(llm, 1, 8, seed=-1)  # warm-up
    single = [decode_rate(llm, 1, DECODE_TOKENS, seed=r) for r in range(repeats)]
    batched = [decode_rate(llm, BATCH, BATCH_TOKENS, seed=100 + r) for r in range(max(1, repeats - 1))]
    return {
        "format": name,
        "load_s": load_s,
        "weight_bytes": info.weight_bytes,
        "num_params": info.num_params,
        "rss_mb": rss_mb(),
        "decode_1": statistics.median(single),
        "decode_8": statistics.median(batched),
        "ppl": perplexity(llm),
        "model_forward": info.model_forward,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["worker"])
    ap.add_argument("--format", choices=list(FORMATS), required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(worker(args.format, args.repeats)))


if __name__ == "__main__":
    main()
