"""Structured outputs (grammar-constrained decoding) on this CPU.

Suites (`--suite`, default `overhead`):

  libraries  xgrammar vs llguidance, no model: the time to compile each schema, and the per-token
             time to fill the next-token bitmasks of a batch (each library's batched call, and
             llguidance row by row on the calling thread as kvserve does), apply them to float32
             logits [batch, vocab] (one apply for all) and accept the chosen tokens, at batch 1 and 8,
             with the SmolLM2 tokenizer. The logits are fixed random rows (seeded) and the token is
             the masked argmax, so both libraries walk the same kind of documents; a sequence that
             reaches 128 tokens or completes starts over. This is what chose the library.
  overhead   constrained-decoding overhead per output token through the engine (kvserve.LLM,
             SmolLM2), at batch 1 and 8. Method: the constrained run (json_schema, greedy) records
             each request's number of output tokens; the free run sends the same prompts with
             `ignore_eos` and `max_tokens` set to exactly those numbers, so both runs compute the
             same prefills and the same decode steps with the same rows in every step, and differ
             only by the grammar work (masks, apply, accept). Prefix caching is off, so every trial
             computes its prompt. Trials alternate the two runs; the medians are compared:
             overhead = constrained ms/token / free ms/token - 1 (target <= 10 %).
  validity   50 json_schema requests (varied schemas: nested objects, enums, arrays) against a
             kvserve server process (SmolLM2), half streamed, half not: how many are schema-valid
             (jsonschema), and the finish reasons.

    python scripts/bench_structured.py --suite libraries|overhead|validity|all [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the validity cases live in tests/e2e

VOCAB_MODEL = "smollm2-135m"
MAX_SIM_TOKENS = 128

# the schemas of every suite: flat with an enum, nested objects, arrays of objects, bounded strings
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["city", "location", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 16},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        "unit": {"enum": ["kg", "g", "piece"]},
                    },
                    "required": ["product", "quantity", "unit"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["items", "paid"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "summary": {"type": "string", "maxLength": 40},
        },
        "required": ["sentiment", "confidence", "summary"],
        "additionalProperties": False,
    },
]


# --- libraries -------------------------------------------------------------------------------------
class _Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        assert all(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())


class _Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.num_words = -(-vocab_size // 32)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(2)
        self.options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        self.llg.LLMatcher(self.tokenizer, grammar)  # builds (and checks) the grammar: its compile
        return grammar

    def matcher(self, grammar: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        assert all(self.executor.consume_token_par(list(zip(matchers, tokens))))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class _LlguidanceSerial(_Llguidance):
    """kvserve's way (kvserve/structured/matcher.py): each row's mask computed on the calling thread."""

    name = "llguidance-serial"

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        words = bytearray().join(m.compute_bitmask() for m in matchers)
        bitmask.copy_(torch.frombuffer(words, dtype=torch.int32).view(len(matchers), -1)[:, : self.num_words])

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        assert all(m.consume_token(t) for m, t in zip(matchers, tokens))


_BITS = torch.arange(32, dtype=torch.int32)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same apply for every library (kvserve's: unpack, masked_fill; the libraries' own are a
    torch.compile'd function (llguidance) and a C++ kernel (xgrammar))."""
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def library_suite(steps: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from kvserve.models.loader import resolve_model_path

    hf = AutoTokenizer.from_pretrained(resolve_model_path(VOCAB_MODEL))
    vocab_size = len(hf)
    eos = [int(hf.eos_token_id)]
    results: dict[str, Any] = {}
    for cls in (_Xgrammar, _Llguidance, _LlguidanceSerial):
        t0 = time.perf_counter()
        lib = cls(hf, vocab_size, eos)
        setup_s = time.perf_counter() - t0
        compile_ms = []
        grammars = []
        for schema in SCHEMAS:
            t0 = time.perf_counter()
            grammars.append(lib.compile(schema))
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        row: dict[str, Any] = {"setup_s": setup_s, "compile_ms": compile_ms}
        for batch in (1, 8):
            row[f"batch{batch}"] = _simulate(lib, grammars, batch, vocab_size, steps)
        results[lib.name] = row
    return results


def _simulate(lib: Any, grammars: list[Any], batch: int, vocab_size: int, steps: int) -> dict[str, float]:
    """`steps` decode steps of `batch` constrained rows: fill, apply, argmax, accept (per-token ms)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(16, batch, vocab_size, generator=gen)
    bitmask = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)
    matchers = [lib.matcher(grammars[i % len(grammars)]) for i in range(batch)]
    lengths = [0] * batch
    fill_s = apply_s = accept_s = 0.0
    for step in range(steps):
        logits = pool[step % len(pool)].clone()
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        _apply(logits, bitmask)
        t2 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()
        t3 = time.perf_counter()
        lib.accept(matchers, tokens)
        t4 = time.perf_counter()
        fill_s, apply_s, accept_s = fill_s + t1 - t0, apply_s + t2 - t1, accept_s + t4 - t3
        for i in range(batch):
            lengths[i] += 1
            if lib.done(matchers[i]) or lengths[i] >= MAX_SIM_TOKENS:
                matchers[i] = lib.matcher(grammars[(i + step) % len(grammars)])
                lengths[i] = 0
    per = 1e3 / (steps * batch)
    return {
        "fill_ms": fill_s * per,
        "apply_ms": apply_s * per,
        "accept_ms": accept_s * per,
        "total_ms": (fill_s + apply_s + accept_s) * per,
    }


def print_libraries(results: dict[str, Any]) -> None:
    print("\nlibraries (per constrained token, ms; compile per schema, ms)")
    print(f"{'library':<19}{'batch':>6}{'fill':>9}{'apply':>9}{'accept':>9}{'total':>9}   compile ms")
    for name, row in results.items():
        compile_ms = " ".join(f"{c:.1f}" for c in row["compile_ms"])
        for batch in (1, 8):
            r = row[f"batch{batch}"]
            print(
                f"{name:<19}{batch:>6}{r['fill_ms']:>9.3f}{r['apply_ms']:>9.3f}{r['accept_ms']:>9.3f}"
                f"{r['total_ms']:>9.3f}   {compile_ms if batch == 1 else ''}"
            )


# --- overhead through the engine ---------------------------------------------------------------------
def overhead_suite(trials: int) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    from kvserve.request import StructuredOutput

    cases = _validity_cases()
    llm = LLM(model=VOCAB_MODEL, max_cache_bytes=400_000_000, enable_prefix_caching=False)
    mask_s = [0.0]
    fill = llm.engine.grammars.allowed_tokens

    def timed_fill(matchers: list[Any]) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return fill(matchers)
        finally:
            mask_s[0] += time.perf_counter() - t0

    llm.engine.grammars.allowed_tokens = timed_fill  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    for batch in (1, 8):
        picked = cases[:8]
        prompts = [llm.to_token_ids([{"role": "user", "content": p + " Answer in JSON."}]) for p, _ in picked]
        constrained = [
            SamplingParams(
                max_tokens=200,
                temperature=0,
                structured=StructuredOutput.of_schema(schema),
            )
            for _, schema in picked
        ]

        _run_groups(
            llm, prompts, constrained, batch
        )  # warm-up: compiles the grammars, first-touch allocations
        _, lengths = _run_groups(llm, prompts, constrained, batch)
        free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        times: dict[str, list[float]] = {"constrained": [], "free": []}
        masks: list[float] = []
        for _ in range(trials):
            mask_s[0] = 0.0
            seconds, got = _run_groups(llm, prompts, constrained, batch)
            assert got == lengths, "greedy constrained lengths changed between trials"
            times["constrained"].append(seconds)
            masks.append(mask_s[0])
            seconds, got = _run_groups(llm, prompts, free, batch)
            assert got == lengths
            times["free"].append(seconds)
        num_tokens = sum(lengths)
        constrained_ms = statistics.median(times["constrained"]) * 1e3 / num_tokens
        free_ms = statistics.median(times["free"]) * 1e3 / num_tokens
        results[f"batch{batch}"] = {
            "dtype": llm.engine.info.dtype,
            "num_requests": len(prompts),
            "num_output_tokens": num_tokens,
            "free_ms_per_token": free_ms,
            "constrained_ms_per_token": constrained_ms,
            "overhead": constrained_ms / free_ms - 1,
            "mask_fill_ms_per_token": statistics.median(masks) * 1e3 / num_tokens,
            "trials": times,
        }
    return results


def _run_groups(llm: Any, prompts: list[list[int]], params: list[Any], batch: int) -> tuple[float, list[int]]:
    """Generate the prompts `batch` at a time; (seconds, output tokens per request)."""
    t0 = time.perf_counter()
    lengths: list[int] = []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params[i : i + batch])
        lengths += [len(o.token_ids) for o in outs]
    return time.perf_counter() - t0, lengths


def print_overhead(results: dict[str, Any]) -> None:
    dtype = results["batch1"]["dtype"]
    print(
        f"\noverhead through the engine (SmolLM2 in {dtype}, greedy, same prompts and output lengths; "
        "ms per output token)"
    )
    print(
        f"{'batch':>5}{'requests':>10}{'tokens':>8}{'free':>9}{'constrained':>13}{'overhead':>10}{'mask fill':>11}"
    )
    for batch in (1, 8):
        r = results[f"batch{batch}"]
        print(
            f"{batch:>5}{r['num_requests']:>10}{r['num_output_tokens']:>8}{r['free_ms_per_token']:>9.2f}"
            f"{r['constrained_ms_per_token']:>13.2f}{r['overhead']:>9.1%}{r['mask_fill_ms_per_token']:>11.3f}"
        )


# --- validity against a live server ------------------------------------------------------------------
def _validity_cases() -> list[tuple[str, dict[str, Any]]]:
    from tests.e2e.test_structured_outputs import VALIDITY_CASES

    return VALIDITY_CASES


def validity_suite() -> dict[str, Any]:
    import tempfile
    from collections import Counter
    from pathlib import Path

    from tests.e2e.conftest import SMOLLM2_FLAGS, launch, stop
    from tests.e2e.test_structured_outputs import VALIDITY_MAX_TOKENS, run_validity

    server = launch(Path(tempfile.mkdtemp()), *SMOLLM2_FLAGS)
    try:
        t0 = time.perf_counter()
        results = run_validity(server.client())
        seconds = time.perf_counter() - t0
    finally:
        stop(server)
    return {
        "num_requests": len(results),
        "num_valid": sum(r["error"] is None for r in results),
        "num_streamed": sum(r["streamed"] for r in results),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in results)),
        "max_tokens": VALIDITY_MAX_TOKENS,
        "seconds": seconds,
        "invalid": [r for r in results if r["error"] is not None],
    }


def print_validity(results: dict[str, Any]) -> None:
    print(
        f"\nvalidity: {results['num_valid']} / {results['num_requests']} schema-valid "
        f"({results['num_streamed']} streamed; finish reasons {results['finish_reasons']}; "
        f"max_tokens {results['max_tokens']}; {results['seconds']:.1f} s)"
    )
    for r in results["invalid"]:
        print(f"  request {r['index']}: {r['finish_reason']}: {r['error']}: {r['text'][:120]!r}")


# --- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=["libraries", "overhead", "validity", "all"], default="overhead")
    parser.add_argument("--steps", type=int, default=400, help="libraries: simulated decode steps per batch")
    parser.add_argument("--trials", type=int, default=3, help="overhead: alternating trials per run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print(describe())
    results: dict[str, Any] = {"machine": describe()}
    if args.suite in ("libraries", "all"):
        results["libraries"] = library_suite(args.steps)
        print_libraries(results["libraries"])
    if args.suite in ("overhead", "all"):
        results["overhead"] = overhead_suite(args.trials)
        print_overhead(results["overhead"])
    if args.suite in ("validity", "all"):
        results["validity"] = validity_suite()
        print_validity(results["validity"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
