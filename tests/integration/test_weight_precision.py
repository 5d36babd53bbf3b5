"""NestedFP weights in the engine (--weight-precision; kvserve/models/nested.py, engine/precision.py):
the fused forward over the planes equals Hugging Face's modeling code over the weights each mode
computes with, caching never changes an answer in either mode, the two precisions never share KV, a
step mixing them equals each alone, and the weights take 2 bytes a parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kernels import cpu_ext
from kvserve.models.cpu_linear import RowInvariantLinear
from kvserve.quant.nestedfp import NestedWeight
from kvserve.request import Request
from tests.integration.helpers import corpus_token_ids, generate_with_logits
from tests.integration.test_codec_invariance import (
    CHUNK,
    GREEDY,
    check_decode_next_to_prefill,
    check_together_equals_alone,
    check_warm_equals_cold,
)

pytestmark = pytest.mark.skipif(bool(cpu_ext.unavailable_reason()), reason="NestedFP needs the CPU extension")

MODES = ("fp16", "fp8")
COMMON = dict(model="tiny-random-llama", chunk_size=CHUNK, block_size=16, max_cache_bytes=50_000_000)


@pytest.fixture(scope="module", params=MODES)
def pair(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    """(cached engine, cold engine cutting prompts at other points), both at one precision."""
    mode = request.param
    cached = LLM(weight_precision=mode, enable_prefix_caching=True, max_num_batched_tokens=512, **COMMON)
    cold = LLM(weight_precision=mode, enable_prefix_caching=False, max_num_batched_tokens=48, **COMMON)
    return cached, cold


@pytest.fixture(scope="module")
def auto() -> LLM:
    return LLM(weight_precision="auto", **COMMON)


def dequantized_reference(mode: str) -> LLM:
    """Hugging Face's modeling code (fp32) over the weights `mode` computes with: every decoder linear's
    dequantized NestedFP weight, and in FP8 mode its input rounded to bf16; the LM head's and the
    embedding's FP16 ones (both FP16 in both modes)."""
    llm = LLM(dtype="float32", model_forward="hf", **COMMON)
    model = llm.engine.model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    source = embed.weight.detach().clone()
    for m in model.modules():
        if isinstance(m, RowInvariantLinear):
            w = NestedWeight.from_float(m.linear.weight.detach()).dequant("fp16" if m is head else mode)
            m.linear.weight = nn.Parameter(w)  # unties a tied head from the embedding
            m.repack()
            if mode == "fp8" and m is not head:
                m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(), *args[1:]))
    embed.weight = nn.Parameter(NestedWeight.from_float(source).dequant("fp16"))
    return llm


@pytest.mark.parametrize("mode", MODES)
def test_nested_forward_equals_hf_over_the_dequantized_weights(mode):
    nested = LLM(weight_precision=mode, **COMMON)
    assert nested.engine.info.model_forward == "fused" and nested.engine.info.dtype == "float32"
    reference = dequantized_reference(mode)
    prompts = [corpus_token_ids(reference, n, seed=n) for n in (7, 90, 200)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (got_out, got), (want_out, want) = (
        generate_with_logits(llm, prompts, params) for llm in (nested, reference)
    )
    assert [o.token_ids for o in got_out] == [o.token_ids for o in want_out]
    assert all(o.weight_precision == mode for o in got_out)
    # FP8 mode rounds each projection's input to bf16, where the two forwards' last-bit differences can
    # fall on either side of a rounding point: 9e-4 apart at most here (logits up to ~4), against 2.4
    # between FP8 mode and the FP16 reference
    tol = 1e-4 if mode == "fp16" else 2e-3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_warm_equals_cold(pair):
    check_warm_equals_cold(*pair, prompt_len=3 * CHUNK + 7, seed=1)


def test_together_equals_alone(pair):
    check_together_equals_alone(*pair, prompt_len=2 * CHUNK + 11, seed=2)


def test_decode_next_to_long_prefill(pair):
    check_decode_next_to_prefill(pair[0], short_len=20, long_len=600, seed=3)


def _run(llm: LLM, prompt: list[int], precision: str, rid: str) -> tuple[list[int], torch.Tensor, int]:
    """One request at a given precision: (tokens, stacked logits, cached prompt tokens)."""
    engine = llm.engine
    engine.update.logits_sink = {}
    try:
        engine.add_request(Request(rid, list(prompt), GREEDY, weight_precision=precision))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        (out,) = outs
        return out.token_ids, torch.stack(engine.update.logits_sink[rid]), out.num_cached_tokens
    finally:
        engine.update.logits_sink = None


def test_the_precisions_never_share_kv(auto):
    prompt = corpus_token_ids(auto, 3 * CHUNK + 5, seed=20)
    _, fp16_logits, cached = _run(auto, prompt, "fp16", "a")
    assert cached == 0
    _, fp8_logits, cached = _run(auto, prompt, "fp8", "b")
    assert cached == 0, "fp8 reused the KV fp16 computed"
    assert not torch.equal(fp8_logits, fp16_logits)
    _, again, cached = _run(auto, prompt, "fp8", "c")
    assert cached == 3 * CHUNK and torch.equal(again, fp8_logits)
    _, again, cached = _run(auto, prompt, "fp16", "d")
    assert cached == 3 * CHUNK and torch.equal(again, fp16_logits)


def test_a_step_mixing_precisions_equals_each_alone(auto):
    prompts = [corpus_token_ids(auto, n, seed=30 + n) for n in (40, 70)]
    alone = [_run(auto, p, mode, f"alone-{mode}")[1] for p, mode in zip(prompts, MODES, strict=True)]
    engine = auto.engine
    engine.update.logits_sink = {}
    try:
        for i, (p, mode) in enumerate(zip(prompts, MODES, strict=True)):
            engine.add_request(
                Request(f"mixed-{i}", list(p), GREEDY, cache_salt="mixed", weight_precision=mode)
            )
        batch_sizes = []
        while engine.has_unfinished_requests():
            batch_sizes.append(len(engine.scheduler.running))
            engine.step()
        together = [torch.stack(engine.update.logits_sink[f"mixed-{i}"]) for i in range(2)]
    finally:
        engine.update.logits_sink = None
    assert max(batch_sizes) == 2
    for got, want in zip(together, alone, strict=True):
        assert torch.equal(got, want)


def test_a_request_stops_caching_where_auto_switches_it(auto):
    """Admitted at fp16, switched to fp8 after its first prefill slice: the chunks it computed at fp16
    are cached (an fp16 request with the same prompt hits them), the rest are not, and it reports
    both precisions."""
    engine, policy = auto.engine, auto.engine.precision
    prompt = corpus_token_ids(auto, 6 * CHUNK + 3, seed=40)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.scheduler.max_num_batched_tokens, budget = 2 * CHUNK, engine.scheduler.max_num_batched_tokens
    hold, policy.hold_s = policy.hold_s, 1e9
    try:
        engine.add_request(Request("switched", list(prompt), params, cache_salt="switch"))
        engine.step()  # the first piece: 2 chunks at fp16
        policy._switch("fp8", 0.0)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    finally:
        engine.scheduler.max_num_batched_tokens = budget
        policy.hold_s = hold
        policy._switch("fp16", 0.0)
    (out,) = outs
    assert out.weight_precision == "fp16+fp8"
    (again,) = auto.generate([prompt], params, cache_salt="switch")
    assert again.weight_precision == "fp16" and again.num_cached_tokens == 2 * CHUNK


def test_weights_take_two_bytes_a_parameter(auto):
    """Both planes are 2 bytes a weight, stored once (a tied head and embedding share them); on top
    come a 4-byte scale an output row and the dense fp32 rest (norms). SmolLM2: 2.007 bytes a
    parameter (docs/weights.md); this tiny model's rows are 64 weights, so its scales weigh more."""
    info = auto.engine.info
    dense_llm = LLM(dtype="float32", **COMMON)
    dense = dense_llm.engine.info
    assert info.num_params == dense.num_params
    linears = [m for m in dense_llm.engine.model.modules() if isinstance(m, RowInvariantLinear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    rows = sum(m.out_features for m in linears)
    assert info.weight_bytes == 2 * weights + 4 * rows + 4 * (info.num_params - weights)
    assert dense.weight_bytes == 4 * dense.num_params + 4 * weights  # fp32 + the kernel's packed copies


def test_refusals(auto):
    with pytest.raises(ConfigError, match="float32"):
        LLM(weight_precision="fp8", dtype="bfloat16", **COMMON)
    with pytest.raises(ConfigError, match="fused"):
        LLM(weight_precision="fp16", model_forward="hf", **COMMON)
    with pytest.raises(InvalidRequestError, match="weight_precision"):
        auto.engine.add_request(Request("bad", [1, 2, 3], GREEDY, weight_precision="fp4"))
