"""Tool calling without a server: request checks, the grammar schemas, the output parser (whole and
streamed in every split), and rendering (the Hermes fallback and a template that renders tools)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kvserve.api import tools
from kvserve.api.protocol import ChatCompletionRequest, ChatMessage
from kvserve.errors import InvalidRequestError
from kvserve.models.loader import resolve_model_path
from kvserve.tokenizer import Tokenizer, hermes_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def _calling(**fields: Any) -> tools.ToolCalling:
    calling = tools.tool_calling(_request(**fields))
    assert calling is not None
    return calling


def _rejected(param: str, **fields: Any) -> str:
    with pytest.raises(InvalidRequestError) as info:
        tools.tool_calling(_request(**fields))
    assert info.value.param == param
    return info.value.message


# --- request ---------------------------------------------------------------------------------------
def test_tool_choice_defaults_and_modes() -> None:
    assert tools.tool_calling(_request()) is None
    assert tools.tool_calling(_request(tools=[WEATHER], tool_choice="none")) is None
    auto = _calling(tools=[WEATHER, TIME])
    assert (auto.mode, auto.names, auto.parallel, auto.structured) == (
        "auto",
        ("get_weather", "get_time"),
        True,
        None,
    )
    named = _calling(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert named.mode == "named" and named.names == ("get_time",)
    assert named.structured is not None and named.structured.source == "tools"
    assert json.loads(named.structured.schema or "") == tools.NO_PARAMETERS
    assert not _calling(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).parallel


def test_bad_tool_requests_are_named_400s() -> None:
    assert "needs tools" in _rejected("tool_choice", tool_choice="required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert "not in tools (get_weather)" in _rejected("tool_choice", tools=[WEATHER], tool_choice=named)
    assert "'get_weather'" in _rejected("tools", tools=[WEATHER, WEATHER])
    assert "response_format" in ChatCompletionRequest.model_fields, "response_format (issue 14, A) is missing"
    message = _rejected(
        "tool_choice", tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
    )
    assert "both constrain" in message


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"tools": []}, ("tools",)),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            ("tools", 0, "function", "name"),
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, ("tools", 0, "type")),
        ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, ("tools", 0, "function", "x")),
        ({"tool_choice": "always"}, ("tool_choice",)),
        ({"parallel_tool_calls": "yes"}, ("parallel_tool_calls",)),
    ],
)
def test_tool_fields_are_strict(body: dict[str, Any], loc: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        _request(**body)
    assert info.value.errors()[0]["loc"][: len(loc)] == loc


def test_tool_messages_are_checked() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ok = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20C"}]},
    ]
    tools.check_messages([ChatMessage.model_validate(m) for m in ok])
    bad = [
        ({"role": "tool", "content": "20C"}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "messages.0.tool_call_id"),
        ({"role": "user", "tool_calls": [call], "content": "x"}, "messages.0.tool_calls"),
        ({"role": "user"}, "messages.0.content"),
        ({"role": "assistant", "content": None}, "messages.0.content"),
    ]
    for message, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            tools.check_messages([ChatMessage.model_validate(message)])
        assert info.value.param == param


# --- grammar schemas -------------------------------------------------------------------------------
def test_required_schema_is_an_array_of_calls_in_name_then_arguments_order() -> None:
    calling = _calling(tools=[WEATHER, TIME], tool_choice="required")
    assert calling.structured is not None and calling.structured.kind == "json_schema"
    schema = json.loads(calling.structured.schema or "")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert list(first["properties"]) == ["name", "arguments"]  # the function is chosen first
    assert first["properties"]["name"] == {"enum": ["get_weather"]}
    assert first["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert second["properties"]["arguments"] == tools.NO_PARAMETERS
    assert first["required"] == ["name", "arguments"] and first["additionalProperties"] is False
    single = _calling(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.structured.schema or "")["maxItems"] == 1  # type: ignore[union-attr]
    assert calling.structured.stop_on_repeated_item  # a repeated call ends the array
    named = _calling(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.structured is not None and not named.structured.stop_on_repeated_item


def test_named_schema_keeps_the_parameters_property_order() -> None:
    params = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    calling = _calling(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert calling.structured is not None
    assert calling.structured.schema == json.dumps(params, separators=(",", ":"))


# --- parsing -------------------------------------------------------------------------------------
def _whole(calling: tools.ToolCalling, text: str, reason: str = "stop") -> tuple[dict[str, Any], str | None]:
    message, finish = tools.message(calling, text, reason)
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    return message, finish


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ]


def test_auto_parses_blocks_and_leaves_the_rest_as_content() -> None:
    auto = _calling(tools=[WEATHER, TIME])
    message, finish = _whole(auto, f"Let me check.\n{CALL}\n")
    assert message["content"] == "Let me check." and finish == "tool_calls"
    assert _calls(message) == [("get_weather", {"city": "Paris"})]
    message, finish = _whole(auto, CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert message["content"] is None and finish == "tool_calls"
    assert _calls(message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    message, finish = _whole(auto, "It is sunny.", "stop")
    assert message == {"role": "assistant", "content": "It is sunny."} and finish == "stop"
    message, finish = _whole(auto, CALL, "length")  # cut off after a call: still length
    assert finish == "length" and len(_calls(message)) == 1


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {</tool_call>',
        "<tool_call>not json</tool_call>",
    ],
)
def test_a_block_that_is_not_a_call_stays_text(block: str) -> None:
    message, finish = _whole(_calling(tools=[WEATHER, TIME]), f"Hi {block} bye")
    assert message == {"role": "assistant", "content": f"Hi {block} bye"} and finish == "stop"


def test_auto_unclosed_block_at_the_end_and_parallel_false() -> None:
    auto = _calling(tools=[WEATHER, TIME])
    message, _ = _whole(auto, '<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert _calls(message) == [("get_time", {})] and message["content"] is None
    message, _ = _whole(auto, '<tool_call>\n{"name": "get_time", "argu')
    assert message["content"] == '<tool_call>\n{"name": "get_time", "argu' and "tool_calls" not in message
    message, _ = _whole(auto, "the tag <tool_ca")  # a prefix of the tag at the end is text
    assert message["content"] == "the tag <tool_ca"
    single = _calling(tools=[WEATHER, TIME], parallel_tool_calls=False)
    message, _ = _whole(single, CALL + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert _calls(message) == [("get_weather", {"city": "Paris"})]


def test_required_parses_array_items() -> None:
    required = _calling(tools=[WEATHER, TIME], tool_choice="required")
    text = '[{"name": "get_weather", "arguments": {"city": "a}\\"]{"}}, {"name":"get_time","arguments":{}}]'
    message, finish = _whole(required, text)
    assert _calls(message) == [("get_weather", {"city": 'a}"]{'}), ("get_time", {})]
    assert message["content"] is None and finish == "tool_calls"
    message, finish = _whole(required, '[{"name": "get_weather", "arguments": {"ci', "length")
    assert message == {"role": "assistant", "content": '[{"name": "get_weather", "arguments": {"ci'}
    assert finish == "length"


def test_a_repeated_call_is_made_once() -> None:
    """What a generation stopped at a repeated item (StructuredOutput.stop_on_repeated_item) looks
    like: the array is left open after the repeat, the repeat is dropped, and the calls stand."""
    required = _calling(tools=[WEATHER, TIME], tool_choice="required")
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    time = '{"name": "get_time", "arguments": {}}'
    message, finish = _whole(required, f"[{weather}, {time}, {time}")
    assert _calls(message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert message["content"] is None and finish == "tool_calls"


def test_named_output_is_the_arguments() -> None:
    named = _calling(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message, finish = _whole(named, '{"city": "Paris"}')
    assert message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


STREAMED = [
    ({}, f"Let me check.\n{CALL}\n{CALL}"),
    ({}, "Hi <tool_call>bad</tool_call> and <tool_c"),
    ({}, "a < b and c <tool_call"),
    ({}, "  plain text with trailing spaces \n"),
    (
        {"tool_choice": "required"},
        '[{"name": "get_weather", "arguments": {"city": "x"}}, {"name": "get_time", "arguments": {}}]',
    ),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, '{"a": [1, 2]}'),
]


@pytest.mark.parametrize(("fields", "text"), STREAMED)
def test_stream_accumulates_to_the_whole_response_in_every_split(fields: dict[str, Any], text: str) -> None:
    calling = _calling(tools=[WEATHER, TIME], **fields)
    whole, whole_finish = tools.message(calling, text, "stop")
    for step in (1, 2, 3, 7, len(text)):
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        stream = calling.stream()
        content, deltas, finish = "", [], None
        for i, piece in enumerate(pieces):
            delta, finish = tools.delta_body(stream, piece, "stop" if i == len(pieces) - 1 else None)
            content += delta.get("content", "")
            deltas += delta.get("tool_calls", [])
            assert "<tool_call>" not in delta.get("content", "") or not whole.get("tool_calls")
        calls = tools.merge_tool_call_deltas(deltas)
        assert (content or None) == whole["content"] and finish == whole_finish
        assert [c["function"] for c in calls] == [c["function"] for c in whole.get("tool_calls", [])]
        assert all("id" in d for d in deltas if "name" in d["function"])


def test_stream_never_shows_the_start_of_a_block() -> None:
    stream = _calling(tools=[WEATHER]).stream()
    assert stream.feed("Hello <tool").content == "Hello"
    delta = stream.feed('_call>{"name": "get_weather", "arguments": {"city": "P"}}')
    assert delta.content == "" and delta.tool_calls == []
    delta = stream.feed("</tool_call>")
    assert delta.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "P"}'}
    assert delta.tool_calls[0]["index"] == 0


# --- rendering -----------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25C"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model_path("smollm2-135m"))


def test_hermes_fallback_through_smollm2_template(smollm2_tokenizer: Tokenizer) -> None:
    assert not smollm2_tokenizer.renders_tools
    text = smollm2_tokenizer.decode(
        smollm2_tokenizer.apply_chat_template(HISTORY, True, [WEATHER]), skip_special_tokens=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n20C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text
    with_system = hermes_messages([{"role": "system", "content": "Be brief."}, *USER], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools\n") and len(with_system) == 2
    assert hermes_messages(USER, None) == USER


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)


def test_a_template_that_renders_tools_receives_them() -> None:
    tok = Tokenizer(resolve_model_path("smollm2-135m"))
    tok.hf.chat_template = TOOL_TEMPLATE
    assert tok.renders_tools
    text = tok.decode(tok.apply_chat_template(HISTORY, False, [WEATHER, TIME]), skip_special_tokens=False)
    assert text == (
        "TOOLS:get_weather;get_time;\n"
        "user:Weather in Paris and Rome?\n"
        "assistant:[call get_weather Paris][call get_weather Rome]\n"  # arguments reach it as objects
        "tool:20C(c1)\n"
        "tool:25C(c2)\n"
    )
