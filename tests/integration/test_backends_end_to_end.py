"""Every available attention backend gives the reference backend's greedy tokens on the default model."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.integration.helpers import corpus_token_ids

BACKENDS = [
    "cpu_paged",
    pytest.param("triton", marks=pytest.mark.gpu),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.cuda_ext]),
]


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list[list[int]], list]:
    llm = LLM(model="smollm2-135m", attention_backend="reference", chunk_size=64, max_cache_bytes=300_000_000)
    prompts = [corpus_token_ids(llm, n, seed=n) for n in (9, 150, 300)]
    prompts.append(prompts[2][:200] + [13, 14, 15])  # a prefix hit: prefill over cached KV
    outs = [llm.generate([p], PARAMS)[0] for p in prompts[:3]] + llm.generate(prompts[3:], PARAMS)
    return llm, prompts, outs


PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_greedy(backend: str, reference: tuple[LLM, list[list[int]], list]):
    _, prompts, expected = reference
    llm = LLM(model="smollm2-135m", attention_backend=backend, chunk_size=64, max_cache_bytes=300_000_000)
    got = [llm.generate([p], PARAMS)[0] for p in prompts[:3]] + llm.generate(prompts[3:], PARAMS)
    assert got[3].num_cached_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
