"""Every cache feature on each model family kvserve serves, on small random-weight models of each
(issue 35), so the default test run needs no model package: tiny-random-llama (Llama: SmolLM2's
family), tiny-random-qwen2 (Qwen2: q/k/v biases, an untied head, RoPE base 1e6) and tiny-random-gemma3
(Gemma 3: sliding-window layers around a global one, a RoPE base per layer type, q/k norms, a final
logit soft-cap).

- exact prefix reuse: cache on == cache off, token for token, logits within float tolerance, for a
  repeat, a full hit and a new suffix after a cached prefix;
- warm == cold, bitwise, under quantized KV codecs (the CPU extension's invariant kernels);
- a disk-tier restart: a new engine on the same directory answers from the disk tier as cold does;
- content reuse is available (the model's RoPE re-rotates and passes the start-up self-check), or for
  a model with sliding-window layers declined with that reason;
- the served forward equals the modeling code's own (transformers' eager attention and masks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ext
from tests.integration.helpers import corpus_token_ids, generate_with_logits
from tests.integration.test_codec_invariance import _engines, check_warm_equals_cold

FAMILIES = ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-gemma3"]
WINDOWED = {"tiny-random-gemma3"}  # sliding-window layers (a 24-token window): content reuse declined
CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TOL = 1e-4  # fp32 logits, cached KV against recomputed (the same kernels, another batch shape)


def make(model: str, **overrides: object) -> LLM:
    common = dict(model=model, chunk_size=CHUNK, block_size=16, max_cache_bytes=50_000_000)
    return LLM(**{**common, **overrides})  # type: ignore[arg-type]


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    (out,), (logits,) = generate_with_logits(llm, [prompt], GREEDY)
    return out.token_ids, logits


@pytest.mark.parametrize("model", FAMILIES)
def test_exact_reuse_equals_no_cache(model: str):
    cached, off = make(model), make(model, enable_prefix_caching=False)
    base = corpus_token_ids(cached, 5 * CHUNK + 9, seed=3)
    cases = {
        "first run": base,
        "repeat": base,
        "full hit": base[: 5 * CHUNK + 1],
        "new suffix": base[: 3 * CHUNK] + corpus_token_ids(cached, 21, seed=4),
    }
    for name, prompt in cases.items():
        ids, logits = run(cached, prompt)
        want_ids, want_logits = run(off, prompt)
        assert ids == want_ids, name
        torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=0, msg=name)
    s = cached.engine.stats()
    assert s.num_hit_tokens >= 5 * CHUNK + 5 * CHUNK + 3 * CHUNK  # the repeat, the full hit, the prefix
    if model in WINDOWED:
        assert not cached.engine.reuse.matcher.enabled
        assert "sliding-window layers" in cached.engine.reuse.matcher.disabled_reason
    else:
        assert cached.engine.reuse.matcher.enabled, cached.engine.reuse.matcher.disabled_reason


@pytest.mark.skipif(bool(cpu_ext.unavailable_reason()), reason="bitwise warm == cold needs the CPU extension")
@pytest.mark.parametrize("codec", ["int8", "int4dq", "kint3-vturbo3"])
@pytest.mark.parametrize("model", FAMILIES)
def test_warm_equals_cold_under_codecs(model: str, codec: str):
    cached, cold = _engines(model, codec)
    check_warm_equals_cold(cached, cold, prompt_len=3 * CHUNK + 7, seed=5)


@pytest.mark.parametrize("model", FAMILIES)
def test_a_disk_tier_restart_answers_as_cold_does(model: str, tmp_path: Path):
    off = make(model, enable_prefix_caching=False)
    prompt = corpus_token_ids(off, 4 * CHUNK + 5, seed=6)
    want_ids, want_logits = run(off, prompt)
    with make(model, kv_disk_dir=str(tmp_path), kv_disk_write="all") as first:  # closing stores the writes
        assert run(first, prompt)[0] == want_ids
    assert len(list(tmp_path.glob("*.kv"))) == 4
    second = make(model, kv_disk_dir=str(tmp_path), kv_disk_write="all")  # the restart
    ids, logits = run(second, prompt)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=0)
    disk = next(t for t in second.engine.stats().tiers if t.tier == "disk")
    assert (disk.hits, disk.loads, disk.corruptions) == (4, 4, 0)
    assert second.engine.stats().num_hit_tokens == 4 * CHUNK
    second.engine.close()


@pytest.mark.parametrize("model", FAMILIES)
def test_the_served_forward_equals_the_modeling_codes(model: str):
    """Greedy tokens and every sampled step's logits against transformers' own forward of the same
    weights (eager attention, its own causal and sliding-window masks) over the whole sequence: for
    tiny-random-gemma3 the prompt is several windows long, so every sliding layer's window is crossed
    in prefill and in decode, and the cached run crosses it again after a prefix hit."""
    from transformers import AutoModelForCausalLM

    llm = make(model)
    prompt = corpus_token_ids(llm, 3 * CHUNK + 11, seed=8)
    hf = AutoModelForCausalLM.from_pretrained(
        llm.engine.info.model_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for name in ("cold", "after a prefix hit"):
        ids, logits = run(llm, prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + ids[:-1]])).logits[0].float()
        n = len(prompt)
        assert ids == ref[n - 1 :].argmax(-1).tolist(), name
        torch.testing.assert_close(logits, ref[n - 1 :], atol=TOL, rtol=0, msg=name)
    assert llm.engine.stats().num_hit_tokens >= 3 * CHUNK
