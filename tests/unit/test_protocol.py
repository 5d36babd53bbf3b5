"""OpenAI request models: unknown fields are named 400s; conversion to SamplingParams."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvserve.api.errors import validation_param_and_message
from kvserve.api.protocol import ChatCompletionRequest, CompletionRequest, WarmRequest
from kvserve.errors import InvalidRequestError


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
    param, _ = _param_of(CompletionRequest, {"prompt": "x", "max_tokens": 0})
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


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(InvalidRequestError):
        CompletionRequest(prompt=[]).prompts()


def test_invalid_values_raise_with_param() -> None:
    cases = [
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ]
    for body, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            CompletionRequest.model_validate(body).to_sampling_params()
        assert info.value.param == param, body


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
    for body in ({}, {"text": "x", "prompt_token_ids": [1]}):
        with pytest.raises(InvalidRequestError):
            WarmRequest.model_validate(body).check()
