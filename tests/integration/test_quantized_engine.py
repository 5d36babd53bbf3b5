"""Quantized KV in the engine: capacity at a fixed byte budget, and prefix reuse exact w.r.t. the codec."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.quant.registry import make_codec
from tests.integration.helpers import corpus_token_ids

BUDGET = 64_000_000
CODECS = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "turbo4", "turbo3.5", "turbo3"]


def test_capacity_at_a_fixed_budget_matches_bits_per_element():
    """SmolLM2's shape (3 KV heads, head_dim 64): tokens held vs bf16 within 3 % of 16 / bits."""
    import torch

    from kvserve.kvcache.quantized_storage import create_layer_kv

    def pool_tokens(codec: str) -> int:
        layer = create_layer_kv(codec, 1, 16, 3, 64, torch.float32, torch.device("cpu"))
        return BUDGET // (layer.bytes_per_block() * 30) * 16

    base = pool_tokens("bf16")
    for codec in CODECS[1:]:
        theory = 16 / make_codec(codec, 3, 64).bits_per_element(16)
        measured = pool_tokens(codec) / base
        assert abs(measured / theory - 1) <= 0.03, (codec, measured, theory)
    assert pool_tokens("int8") / base >= 1.7 and pool_tokens("turbo4") / base >= 3.6


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "turbo4"])
def test_prefix_reuse_is_exact_with_respect_to_the_codec(codec: str):
    common = dict(model="tiny-random-llama", kv_cache_dtype=codec, chunk_size=32, max_cache_bytes=BUDGET)
    cached, cold = LLM(**common), LLM(enable_prefix_caching=False, **common)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    base = corpus_token_ids(cached, 4 * 32 + 5, seed=7)
    cached.generate([base], params)
    cached.engine.check_integrity_each_step = True
    for prompt in (base[: 3 * 32] + [11, 12, 13], base + [21, 22]):
        (warm,) = cached.generate([prompt], params)
        (ref,) = cold.generate([prompt], params)
        assert warm.num_cached_tokens >= 3 * 32 and warm.token_ids == ref.token_ids, codec
    stats = cached.stats()
    assert stats.kv_codec == codec and stats.bytes_per_token < 4 * 2 * 2 * 16 * 4
