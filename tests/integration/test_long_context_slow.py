"""Long prompts on the real model: chunked prefill + prefix reuse stay exact (slow: make test-slow)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.integration.helpers import corpus_token_ids

pytestmark = pytest.mark.slow


def test_long_shared_prefix_with_chunked_prefill_is_exact():
    common = dict(model="smollm2-135m", max_cache_bytes=1_000_000_000, max_num_batched_tokens=512)
    cached, cold = LLM(**common), LLM(enable_prefix_caching=False, **common)
    cached.engine.check_integrity_each_step = True
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    shared = corpus_token_ids(cached, 2048, seed=1)
    prompts = [shared + corpus_token_ids(cached, 64, seed=10 + i) for i in range(3)]
    outs = cached.generate(prompts, params)
    refs = cold.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert sorted(o.num_cached_tokens for o in outs) == [0, 2048, 2048]
