"""Tool calling against a real SmolLM2 server through the OpenAI SDK: named and `required` tool
choices give schema-valid calls (the grammar enforces them), streamed calls accumulate to the
non-streamed ones (greedy), tool-result histories are answered, `auto` is parsed, bad requests are 400s."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import SMOLLM2, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY: dict[str, Any] = {"model": SMOLLM2, "temperature": 0, "max_tokens": 48}


def _schema_errors(value: Any, schema: dict[str, Any], at: str = "$") -> list[str]:
    """The schema keywords these tests use (type, properties, required, additionalProperties, enum,
    maxLength), checked by hand: no validator library is installed."""
    kinds = {"object": dict, "string": str, "integer": int, "array": list}
    kind = schema.get("type")
    if kind and not (isinstance(value, kinds[kind]) and not isinstance(value, bool)):
        return [f"{at}: {value!r} is not {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} not in {schema['enum']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{at}: longer than {schema['maxLength']}")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: unexpected {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += _schema_errors(v, props[k], f"{at}.{k}")
    return errors


def _valid_call(call: Any) -> tuple[str, dict[str, Any]]:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert _schema_errors(arguments, SCHEMAS[call.function.name]) == [], call.function.arguments
    return call.function.name, arguments


def test_named_tool_choice_gives_a_valid_call(smollm2_server: Server) -> None:
    response = smollm2_server.client().chat.completions.create(
        messages=ASK, tools=[WEATHER, ADD], tool_choice=NAMED, **GREEDY
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls or []) == 1
    name, arguments = _valid_call(choice.message.tool_calls[0])  # type: ignore[index]
    assert name == "get_weather" and arguments["city"]


def test_required_gives_valid_calls(smollm2_server: Server) -> None:
    client = smollm2_server.client()
    ask = [{"role": "user", "content": "What is 2 plus 3? And the weather in Rome?"}]
    response = client.chat.completions.create(
        messages=ask, tools=[WEATHER, ADD], tool_choice="required", **{**GREEDY, "max_tokens": 80}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls or []) >= 1
    for call in choice.message.tool_calls or []:
        _valid_call(call)
    single = client.chat.completions.create(
        messages=ask, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, **GREEDY
    )
    assert (
        single.choices[0].finish_reason == "tool_calls"
        and len(single.choices[0].message.tool_calls or []) == 1
    )
    _valid_call(single.choices[0].message.tool_calls[0])  # type: ignore[index]


def _streamed(server: Server, **kwargs: Any) -> tuple[list[dict[str, Any]], list[str | None], Any]:
    """Each choice's accumulated tool calls, its finish reason, and the usage chunk's usage."""
    stream = server.client().chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    calls: dict[int, list[dict[str, Any]]] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                acc = calls.setdefault(c.index, [])
                if d.index == len(acc):
                    assert d.id and d.type == "function" and d.function and d.function.name
                    acc.append({"name": d.function.name, "arguments": d.function.arguments or ""})
                else:
                    acc[d.index]["arguments"] += d.function.arguments or ""  # type: ignore[union-attr]
            assert not c.delta.content or "<tool_call>" not in c.delta.content
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    n = kwargs.get("n", 1)
    return [calls.get(i, []) for i in range(n)], [finish.get(i) for i in range(n)], usage


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_calls_equal_the_whole_response(smollm2_server: Server, tool_choice: Any) -> None:
    kwargs = {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": tool_choice, **GREEDY}
    whole = smollm2_server.client().chat.completions.create(**kwargs)
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls or []
    ]
    assert expected
    calls, finish, usage = _streamed(smollm2_server, n=2, **kwargs)
    assert calls == [expected, expected] and finish == ["tool_calls", "tool_calls"]
    assert usage.completion_tokens == 2 * whole.usage.completion_tokens  # type: ignore[union-attr]


class GetWeather(BaseModel):
    city: str


def test_sdk_stream_helper_and_parse(smollm2_server: Server) -> None:
    """The SDK's own accumulation (chat.completions.stream) and parsed arguments (strict tools)."""
    client = smollm2_server.client()
    kwargs: Any = {
        "messages": ASK,
        "tools": [openai.pydantic_function_tool(GetWeather)],
        "tool_choice": {"type": "function", "function": {"name": "GetWeather"}},
        **GREEDY,
    }
    parsed = client.chat.completions.parse(**kwargs).choices[0].message.tool_calls[0]  # type: ignore[index]
    assert isinstance(parsed.function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert "".join(deltas) == call.function.arguments == parsed.function.arguments
    assert call.function.parsed_arguments == parsed.function.parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_history_is_answered(smollm2_server: Server) -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    response = smollm2_server.client().chat.completions.create(
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        **GREEDY,  # type: ignore[arg-type]
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content
    assert response.usage.prompt_tokens > 200  # type: ignore[union-attr]  # the tools block was rendered


def test_auto_returns_content_or_parsed_calls(smollm2_server: Server) -> None:
    client = smollm2_server.client()
    for messages in (ASK, [{"role": "user", "content": "Write one sentence about the sea."}]):
        choice = client.chat.completions.create(messages=messages, tools=[WEATHER, ADD], **GREEDY).choices[0]
        calls = choice.message.tool_calls or []
        assert calls or choice.message.content
        for call in calls:  # a parsed call has a known name and object arguments (not schema-checked)
            assert call.function.name in SCHEMAS
            assert isinstance(json.loads(call.function.arguments), dict)
        assert choice.finish_reason == ("tool_calls" if calls else choice.finish_reason)
        assert "<tool_call>" not in (choice.message.content or "") or not calls


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "21C"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ],
)
def test_bad_tool_requests_are_400s(smollm2_server: Server, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        smollm2_server.client().chat.completions.create(**{"messages": ASK, **GREEDY, **fields})
    assert info.value.body["param"] == param, info.value.message  # type: ignore[index]
