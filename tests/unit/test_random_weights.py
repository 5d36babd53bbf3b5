"""Random-weight models of real shapes (kvserve/models/random_weights.py): built from the seed on the
device, named like any model directory, and served with a vocabulary wider than the tokenizer's
without ever sampling or scoring an id the tokenizer lacks."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.loader import model_fingerprint, resolve_model_path
from kvserve.models.random_weights import MARKER, SHAPES, load_random_model, write_random_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY |= dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
TOKENIZER_VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny Llama whose lm_head has 8,000 rows more than the tokenizer has tokens."""
    target = tmp_path_factory.mktemp("wide") / "model"
    return write_random_model(
        "smollm2-135m", target, resolve_model_path("smollm2-135m"), vocab_size=TOKENIZER_VOCAB + 8000, **TINY
    )


def test_directory_holds_config_tokenizer_and_seed_but_no_weights(wide):
    assert json.loads((wide / MARKER).read_text())["seed"] == 0
    assert (wide / "config.json").exists() and (wide / "tokenizer.json").exists()
    assert not list(wide.glob("*.safetensors"))


def test_same_seed_same_weights_and_the_seed_is_in_the_fingerprint(wide, tmp_path):
    a = load_random_model(wide, torch.device("cpu"), torch.float32)
    b = load_random_model(wide, torch.device("cpu"), torch.float32)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    norm = dict(a.named_parameters())["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    assert a.lm_head.weight.shape[0] == TOKENIZER_VOCAB + 8000
    other = write_random_model(
        "smollm2-135m", tmp_path / "m", wide, seed=1, vocab_size=TOKENIZER_VOCAB + 8000, **TINY
    )
    assert model_fingerprint(other) != model_fingerprint(wide)


def test_llama_8b_shape_is_the_real_one():
    s = SHAPES["llama-3.1-8b"]
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_key_value_heads"], s["vocab_size"]) == (
        4096,
        32,
        8,
        128256,
    )


def test_builtin_name_for_an_unknown_shape_says_which_exist():
    from kvserve.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="random:llama-3.1-8b"):
        resolve_model_path("random:llama-9")


def test_never_samples_or_scores_ids_past_the_tokenizer(wide):
    """Before the fix a sixth of the random lm_head's mass sat on ids no tokenizer can decode, and
    greedy and sampled decoding picked them (the H200 run's engine bench failed on one)."""
    llm = LLM(model=str(wide), max_cache_bytes=20_000_000, chunk_size=32)
    assert llm.engine.info.vocab_size == TOKENIZER_VOCAB
    assert llm.engine.info.logits_size == TOKENIZER_VOCAB + 8000
    prompt = list(range(100, 140))
    params = [
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5),
        SamplingParams(max_tokens=48, temperature=1.5, seed=3, ignore_eos=True, logprobs=5),
    ]
    for out in llm.generate([prompt, prompt], params):
        assert out.error is None
        assert max(out.token_ids) < TOKENIZER_VOCAB
        for lp in out.logprobs:
            assert all(t < TOKENIZER_VOCAB for t, _ in lp.top)
        probs = [sum(math_exp(v) for _, v in lp.top) for lp in out.logprobs]
        assert all(p <= 1.0 + 1e-5 for p in probs)
    scored = llm.generate([prompt], params[0])[0].prompt_logprobs[1:]
    assert all(t < TOKENIZER_VOCAB for lp in scored for t, _ in lp.top)


def math_exp(x: float) -> float:
    import math

    return math.exp(x)
