"""kvserve.request: documented ranges, the one vocabulary check, n-sample fan-out and warm requests."""

from __future__ import annotations

import math

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.request import (
    INT64_MAX,
    INT64_MIN,
    MIN_TEMPERATURE,
    RANGES,
    Range,
    ReuseOptions,
    SamplingParams,
    check_token_ids,
    sample_requests,
    warm_request,
)


def _param(**kwargs: object) -> str | None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    return info.value.param


def test_range_membership_and_text() -> None:
    closed, open_low = Range(0.0, 2.0), Range(0.0, 1.0, low_open=True)
    assert 0.0 in closed and 2.0 in closed and 2.0001 not in closed and math.nan not in closed
    assert 0.0 not in open_low and 1e-9 in open_low and 1.0 in open_low
    assert (str(closed), str(open_low)) == ("[0.0, 2.0]", "(0.0, 1.0]")


def test_every_numeric_sampling_value_is_range_checked() -> None:
    bad = {
        "max_tokens": [-1, 2**31],  # 0 is a prompt-only request
        "temperature": [-0.1, 100.5, math.nan, math.inf],
        "top_p": [0.0, 1.01, math.nan],
        "top_k": [-2, 2**31],
        "min_p": [-0.1, 1.1],
        "repetition_penalty": [0.0, 1e-3, 1e308, math.nan, math.inf],
        "presence_penalty": [2.5, math.nan],
        "frequency_penalty": [-2.5],
        "n": [0, 17],
        "seed": [INT64_MAX + 1, INT64_MIN - 1],
        "logprobs": [-1, 21],
        "prompt_logprobs": [-1, 21],
    }
    for name, values in bad.items():
        for value in values:
            assert _param(**{name: value}) == name, (name, value)
    assert _param(logit_bias={5: 100.5}) == "logit_bias"
    assert _param(logit_bias={5: math.nan}) == "logit_bias"
    SamplingParams(seed=INT64_MIN, logit_bias={5: -100.0}, repetition_penalty=100.0, top_k=-1)


def test_a_tiny_positive_temperature_is_raised_to_vllms_floor() -> None:
    assert SamplingParams(temperature=1e-45).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_the_vocabulary_check_names_the_parameter() -> None:
    check_token_ids([0, 9], 10, "prompt")
    check_token_ids([], 10, "prompt")
    for ids in ([10], [-1], [3, 10**12]):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
            check_token_ids(ids, 10, "tokens")
        assert info.value.param == "tokens"
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[0, 9]).check_vocab(10)
    for params, name in (
        (SamplingParams(logit_bias={10: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        (SamplingParams(stop_token_ids=[10**12]), "stop_token_ids"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            params.check_vocab(10)
        assert info.value.param == name


def test_reuse_options_ranges() -> None:
    for kwargs, name in (
        ({"recompute_tokens": -1}, "recompute_tokens"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"blend_check_layer": 2**31}, "blend_check_layer"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            ReuseOptions(**kwargs)  # type: ignore[arg-type]
        assert info.value.param == name
    assert set(RANGES) >= {"recompute_tokens", "recompute_ratio", "blend_check_layer"}


def test_sample_requests_fan_out_with_consecutive_seeds() -> None:
    params = SamplingParams(n=3, seed=7, max_tokens=2)
    requests = sample_requests("job-0", [1, 2], params, cache_salt="t", reuse=ReuseOptions(reuse="any"))
    assert [r.request_id for r in requests] == ["job-0-0", "job-0-1", "job-0-2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.prompt_token_ids == [1, 2] and r.cache_salt == "t" for r in requests)
    assert requests[0].prompt_token_ids is not requests[1].prompt_token_ids
    # the seed wraps inside int64 instead of overflowing torch's generator
    top = sample_requests("j", [1], SamplingParams(n=2, seed=INT64_MAX))
    assert [r.sampling_params.seed for r in top] == [INT64_MAX, INT64_MIN]
    unseeded = sample_requests("j", [1], SamplingParams(n=2))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    (single,) = sample_requests("j", [1], SamplingParams(seed=5))
    assert single.sampling_params.seed == 5 and single.request_id == "j-0"


def test_warm_request() -> None:
    r = warm_request("w", [1, 2, 3], pin=False, cache_salt="s")
    assert (r.warm_only, r.pin, r.cache_salt, r.prompt_token_ids) == (True, False, "s", [1, 2, 3])
    assert r.sampling_params.max_tokens == 1


def test_generate_refuses_a_params_list_that_does_not_match_the_prompts():
    """Issue 32.7: zip without strict silently dropped the extra prompts."""
    from kvserve import LLM, SamplingParams
    from kvserve.errors import InvalidRequestError

    llm = LLM(model="tiny-random-llama", max_cache_bytes=20_000_000)
    one = SamplingParams(max_tokens=1)
    with pytest.raises(InvalidRequestError, match="3 prompts but 2 sampling params"):
        llm.generate([[5, 6], [7, 8], [9, 10]], [one, one])
    assert len(llm.generate([[5, 6], [7, 8]], [one, one])) == 2
