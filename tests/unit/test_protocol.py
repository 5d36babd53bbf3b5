"""OpenAI request models: unknown fields are named 400s; conversion to SamplingParams."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvserve.api.errors import validation_param_and_message
from kvserve.api.protocol import ChatCompletionRequest, CompletionRequest, WarmRequest
from kvserve.errors import InvalidRequestError

MSGS = [{"role": "user", "content": "x"}]


def _param_of(model: type, body: dict) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_param_and_message(RequestValidationError(errors))


def test_unknown_parameter_is_named() -> None:
    param, message = _param_of(CompletionRequest, {"prompt": "x", "suffix": "y"})
    assert param == "suffix" and "unsupported parameter: suffix" in message
    param, _ = _param_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": []})
    assert param == "tools"


def test_bad_value_names_its_path() -> None:
    param, _ = _param_of(CompletionRequest, {"prompt": "x", "max_tokens": -1})
    assert param == "max_tokens"
    param, _ = _param_of(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    assert param is not None and param.startswith("messages.0.content")
    param, message = _param_of(CompletionRequest, {})
    assert param == "prompt" and "missing" in message


def test_completion_conversion() -> None:
    body = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "max_tokens": 7,
            "temperature": 0,
            "top_k": 5,
            "min_p": 0.1,
            "stop": "\n",
            "stop_token_ids": [3],
            "seed": 4,
            "logprobs": 2,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.1,
            "repetition_penalty": 1.1,
            "logit_bias": {"12": -100},
            "ignore_eos": True,
            "n": 2,
        }
    )
    p = body.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_k, p.min_p, p.stop, p.stop_token_ids) == (
        7,
        0.0,
        5,
        0.1,
        ("\n",),
        (3,),
    )
    assert (p.seed, p.logprobs, p.logit_bias, p.ignore_eos, p.n) == (4, 2, {12: -100.0}, True, 2)
    assert CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params().max_tokens == 16


def test_echo_with_logprobs_scores_the_prompt_and_allows_max_tokens_0() -> None:
    def params(**body: object) -> tuple[int, int | None, int | None]:
        p = CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params()
        return p.max_tokens, p.logprobs, p.prompt_logprobs

    assert params(echo=True, logprobs=1, max_tokens=0) == (0, 1, 1)
    assert params(echo=True, logprobs=0, max_tokens=1) == (1, 0, 0)
    assert params(echo=True, max_tokens=0) == (0, None, None)  # the prompt's text alone
    assert params(logprobs=3) == (16, 3, None)  # without echo the prompt is not scored


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ("", [], [[]], [[1], []]):
        assert _rejected(CompletionRequest, {"prompt": empty})[0] == "prompt", empty


def _rejected(model: type, body: dict) -> tuple[str | None, str]:
    """(param, message) of the 400 a body gets: from validation or from the conversion."""
    try:
        request = model.model_validate(body)
    except ValidationError:
        return _param_of(model, body)
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params() if model is CompletionRequest else request.to_sampling_params(10)
    return info.value.param, info.value.message


def test_invalid_values_raise_with_param() -> None:
    cases = [
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ]
    for body, param in cases:
        assert _rejected(CompletionRequest, body)[0] == param, body


def test_types_are_strict() -> None:
    for extra, param in [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"n": 2.0}, "n"),
        ({"temperature": "1"}, "temperature"),
        ({"stop_token_ids": [False]}, "stop_token_ids.0"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
    ]:
        assert _rejected(CompletionRequest, {"prompt": "x", **extra})[0] == param, extra
    # a float parameter takes a JSON integer
    assert CompletionRequest.model_validate({"prompt": "x", "temperature": 1}).temperature == 1.0


def test_a_union_names_its_members() -> None:
    param, message = _rejected(CompletionRequest, {"prompt": [True, False]})
    assert param == "prompt"
    assert message == (
        "invalid value for prompt: expected a non-empty string, or a non-empty list of strings, "
        "of token ids or of token-id lists"
    )
    param, message = _rejected(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert (param, message) == (
        "messages.0.content",
        "invalid value for messages.0.content: expected a string or a list of text parts "
        "(null only in an assistant message with tool_calls)",
    )


def test_ranges_are_stated_and_nan_is_out_of_every_range() -> None:
    param, message = _rejected(CompletionRequest, {"prompt": "x", "repetition_penalty": 1e308})
    assert (param, message) == (
        "repetition_penalty",
        "repetition_penalty must be a finite number in [0.01, 100.0] (got 1e+308)",
    )
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            assert _rejected(CompletionRequest, {"prompt": "x", name: value})[0] == name, (name, value)
    assert _rejected(ChatCompletionRequest, {"messages": MSGS, "max_completion_tokens": 0})[0] == (
        "max_completion_tokens"
    )
    assert "[0, 20]" in _rejected(ChatCompletionRequest, {"messages": MSGS, "top_logprobs": 21})[1]
    assert _rejected(CompletionRequest, {"prompt": "x", "seed": 2**63})[0] == "seed"
    assert CompletionRequest.model_validate({"prompt": "x", "seed": -(2**63)}).seed == -(2**63)


def test_lone_surrogates_are_named() -> None:
    param, message = _rejected(CompletionRequest, {"prompt": ["ok", "a\ud800"]})
    assert param == "prompt" and "surrogate" in message
    param, _ = _rejected(ChatCompletionRequest, {"messages": [{"role": "user", "content": "\udfff"}]})
    assert param == "messages"  # the outer field finds it first
    param, _ = _rejected(CompletionRequest, {"prompt": "x", "logit_bias": {"\ud800": 1}})
    assert param == "logit_bias"
    assert CompletionRequest.model_validate({"prompt": "caf\u00e9 \U0001f600"}).prompt  # paired: fine


def test_lone_surrogates_deep_in_a_schema_are_found_and_paired_ones_pass() -> None:
    def body(text: str) -> dict:
        schema = {"type": "object", "properties": {"a": {"description": ["x", {"y": text}]}}}
        return {
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        }

    param, message = _rejected(CompletionRequest, body("\U0001f600 \udfff"))
    assert param == "response_format" and "character 2" in message
    for text in ("a \\ud800 b", "\U0001f600 caf\u00e9"):  # a backslash then text; a paired surrogate
        assert CompletionRequest.model_validate(body(text)).response_format


def test_a_missing_or_wrong_body_says_what_to_send() -> None:
    missing = RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert validation_param_and_message(missing, WarmRequest.expects) == (
        None,
        "the request body is missing: send a JSON object with exactly one of text, prompt_token_ids or messages",
    )
    wrong = RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "msg": "x"}])
    assert validation_param_and_message(wrong)[1] == "the request body must be a JSON object"


def test_chat_conversion() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = ChatCompletionRequest.model_validate(
        {"messages": msgs, "max_tokens": 9, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}
    )
    p = body.to_sampling_params(max_tokens_left=100)
    assert (p.max_tokens, p.logprobs) == (5, 3)
    assert body.message_dicts() == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    p = ChatCompletionRequest.model_validate({"messages": msgs}).to_sampling_params(max_tokens_left=100)
    assert (p.max_tokens, p.logprobs) == (100, None)
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate({"messages": msgs, "top_logprobs": 2}).to_sampling_params(10)
    assert info.value.param == "top_logprobs"


def test_warm_request_needs_exactly_one_source() -> None:
    WarmRequest(text="x").check()
    for body, given in (({}, "none"), ({"text": "x", "prompt_token_ids": [1]}, "text, prompt_token_ids")):
        with pytest.raises(InvalidRequestError) as info:
            WarmRequest.model_validate(body).check()
        assert info.value.message.endswith(f"(got {given})")
