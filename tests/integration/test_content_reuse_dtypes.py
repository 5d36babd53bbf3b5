"""Position-independent reuse in bfloat16 and float16, not only float32 (issue 11).

In low precision the start-up RoPE self-check used to fail against a float32 threshold, which turned
approximate reuse off for the whole server. These run the whole path on CPU in each dtype.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.request import ReuseOptions
from kvserve.reuse.build import check_content_reuse, check_reuse_request, require_content_reuse
from tests.integration.helpers import corpus_token_ids, generate_with_logits

CHUNK = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DTYPES = ["bfloat16", "float16"]
LOGIT_TOLERANCE = {"bfloat16": 0.05, "float16": 0.01}  # a few units in the last place at |logit| ~3


def make(dtype: str, **kw) -> LLM:
    kw.setdefault("pieces", "fixed")  # piece boundaries, and so the counts below, are exact
    kw.setdefault("reuse_min_saving", -10.0)  # take every match: these tests check the repair
    return LLM(model="tiny-random-llama", dtype=dtype, chunk_size=CHUNK, max_cache_bytes=50_000_000, **kw)


@pytest.fixture(scope="module", params=DTYPES)
def llms(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    return make(request.param), make(request.param, enable_prefix_caching=False)


def test_content_reuse_is_available(llms: tuple[LLM, LLM]):
    stats = llms[0].stats().content_reuse
    assert stats.available and stats.reason == "", stats.reason


def test_documents_in_new_orders_are_reused_and_full_repair_equals_cold_prefill(llms: tuple[LLM, LLM]):
    llm, cold = llms
    docs = [corpus_token_ids(llm, 3 * CHUNK, seed=10 + i) for i in range(3)]
    for d in docs:
        llm.warm(d)
    header = corpus_token_ids(llm, 2 * CHUNK, seed=101)  # not cached
    for order in ([2, 0, 1], [1, 2, 0]):
        prompt = header + [t for i in order for t in docs[i]] + corpus_token_ids(llm, 7, seed=201)
        (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
        (plain,), _ = generate_with_logits(
            llm, [prompt], GREEDY, ReuseOptions(reuse="any", recompute_strategy="none")
        )
        assert plain.num_approx_cached_tokens == 9 * CHUNK and plain.num_recomputed_tokens == 0, order
        full = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
        (out,), (logits,) = generate_with_logits(llm, [prompt], GREEDY, full)
        assert out.num_recomputed_tokens == 9 * CHUNK, order
        assert out.token_ids == ref.token_ids, order
        error = (logits - ref_logits).abs().max().item()
        assert error <= LOGIT_TOLERANCE[llm.engine.info.dtype], (order, error)
    llm.engine.check_integrity()


def test_content_defined_pieces_are_found_at_a_new_offset(llms: tuple[LLM, LLM]):
    llm = make(llms[0].engine.info.dtype, pieces="content", piece_min_tokens=8)
    doc = corpus_token_ids(llm, 300, seed=50)
    llm.warm(doc)
    prompt = corpus_token_ids(llm, 45, seed=51) + doc + corpus_token_ids(llm, 5, seed=52)
    (out,) = llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any", recompute_strategy="none"))
    assert out.num_approx_cached_tokens >= 150


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)], ids=str
)
def test_smollm2_self_check_passes_in_low_precision(dtype: torch.dtype):
    """SmolLM2 in bfloat16: 30 layers, recompute error up to 2.5e-2 at the deepest (the old check failed
    at 1.56e-02). About 2.5 s here; float16 on CPU takes 4 s and is marked slow."""
    from kvserve.config import ServeConfig
    from kvserve.engine.builder import load_model

    model, _ = load_model(ServeConfig(model="smollm2-135m"), torch.device("cpu"), dtype)
    rotator, reason = check_content_reuse(model)
    assert rotator is not None, reason


# --- when approximate reuse is unavailable, asking for it is an error, not a silent prefix-only answer


def test_a_request_for_reuse_any_where_it_is_unavailable_is_a_400_naming_reuse():
    reason = "model type 'gpt2' is not supported for approximate reuse"
    with pytest.raises(InvalidRequestError, match="gpt2") as err:
        check_reuse_request(ReuseOptions(reuse="any"), available=False, reason=reason)
    assert err.value.status == 400 and err.value.param == "reuse" and "reuse='prefix'" in err.value.message
    for options in (None, ReuseOptions(reuse="prefix")):
        check_reuse_request(options, available=False, reason=reason)
    check_reuse_request(ReuseOptions(reuse="any"), available=True, reason="")


def test_repair_and_audit_options_on_an_exact_only_request_are_a_400_naming_them():
    for name, value in (("recompute_strategy", "none"), ("recompute_ratio", 0.2), ("audit", True)):
        options = ReuseOptions(**{name: value})
        with pytest.raises(InvalidRequestError, match="reuse='any'") as err:
            check_reuse_request(options, available=True, reason="")  # the server default: prefix
        assert err.value.status == 400 and err.value.param == name
        with pytest.raises(InvalidRequestError):
            check_reuse_request(ReuseOptions(reuse="prefix", **{name: value}), True, "", default_reuse="any")
        check_reuse_request(options, available=True, reason="", default_reuse="any")  # honoured there


def test_a_server_started_with_reuse_any_where_it_is_unavailable_fails_at_start_up():
    with pytest.raises(ConfigError, match="--reuse prefix") as err:
        require_content_reuse("any", None, "RoPE self-check failed (...)")
    assert err.value.param == "reuse" and "self-check" in err.value.message
    require_content_reuse("prefix", None, "RoPE self-check failed (...)")
    require_content_reuse("any", object(), "")


@pytest.fixture
def reuse_unavailable(monkeypatch: pytest.MonkeyPatch) -> str:
    reason = "RoPE self-check failed (made to fail by the test)"
    monkeypatch.setattr("kvserve.reuse.build.check_content_reuse", lambda model: (None, reason))
    return reason


def test_engine_refuses_a_reuse_any_request_it_cannot_honour(reuse_unavailable: str):
    llm = make("float32")
    prompt = corpus_token_ids(llm, 3 * CHUNK, seed=1)
    with pytest.raises(InvalidRequestError, match="made to fail"):
        llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any"))
    (out,) = llm.generate([prompt], GREEDY)  # the default (prefix) is served
    assert out.finish_reason is not None


def test_engine_with_reuse_any_it_cannot_honour_fails_at_start_up(reuse_unavailable: str):
    with pytest.raises(ConfigError, match="made to fail"):
        make("float32", reuse="any")
