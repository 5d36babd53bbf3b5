"""langchain-openai's ChatOpenAI against a live SmolLM2 server (fp32): plain and streamed chat, structured
output through response_format (json_schema and json_object, whole and streamed) and through a forced
tool call, tools bound with `required` and named choices (whole and streamed), and a history with the
tool's result sent back."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import SMOLLM2, Server

# langchain-openai dumps the SDK's parsed completion, whose `parsed` field is typed None, with a City in it
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")

QUESTION = "What is the capital of France?"
MAX_TOKENS = 48
# room for a small JSON object or tool call; a complete schema ends generation before it
STRUCTURED_MAX_TOKENS = 128


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country it is in")
    size: Literal["village", "town", "city"]
    landmarks: list[str] = Field(description="up to two famous places", max_length=2)


class Capital(BaseModel):
    name: str
    country: str


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Get the current local time in a city."""

    city: str


def _chat(server: Server, max_tokens: int = MAX_TOKENS, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=SMOLLM2,
        temperature=0,
        max_tokens=max_tokens,  # type: ignore[call-arg]
        max_retries=0,
        **kwargs,
    )


def test_invoke_and_stream_are_the_servers_greedy_answer(smollm2_server: Server) -> None:
    llm = _chat(smollm2_server, stream_usage=True)
    invoked = llm.invoke(QUESTION)
    chunks = list(llm.stream(QUESTION))
    direct = smollm2_server.client().chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(invoked, AIMessage) and invoked.content == direct.choices[0].message.content
    assert "Paris" in invoked.content
    assert len(chunks) > 2 and "".join(str(c.content) for c in chunks) == invoked.content
    streamed = sum(chunks[1:], chunks[0])  # AIMessageChunk addition: usage from the include_usage chunk
    assert streamed.usage_metadata is not None and invoked.usage_metadata is not None
    assert streamed.usage_metadata["output_tokens"] == invoked.usage_metadata["output_tokens"]
    assert invoked.response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("method", "schema", "prompt"),
    [
        ("json_schema", City, "Describe Paris as JSON."),
        ("json_mode", Capital, 'Describe Paris as a JSON object with the keys "name" and "country".'),
    ],
)
def test_with_structured_output(
    smollm2_server: Server, method: str, schema: type[BaseModel], prompt: str
) -> None:
    """json_schema (langchain-openai's default) is enforced by the grammar: even a 135M model returns a
    valid City. json_mode only guarantees a JSON object: the keys are asked for in the prompt, as
    langchain expects the user to do."""
    structured = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS).with_structured_output(
        schema, method=method, include_raw=True
    )
    out = structured.invoke(prompt)
    raw = out["raw"]
    assert isinstance(raw, AIMessage) and raw.response_metadata["finish_reason"] == "stop"
    assert out["parsing_error"] is None, out["parsing_error"]
    assert isinstance(out["parsed"], schema) and out["parsed"] == schema.model_validate_json(str(raw.content))


def test_streamed_structured_output_equals_invoked(smollm2_server: Server) -> None:
    structured = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS).with_structured_output(City)
    invoked = structured.invoke("Describe Paris as JSON.")
    streamed = list(structured.stream("Describe Paris as JSON."))
    assert isinstance(invoked, City) and streamed and streamed[-1] == invoked


def test_structured_output_through_a_forced_tool_call(smollm2_server: Server) -> None:
    """method="function_calling" binds the schema as a tool with a named tool_choice and
    parallel_tool_calls=false: the grammar makes the model call it with valid arguments."""
    llm = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS)
    structured = llm.with_structured_output(City, method="function_calling")
    city = structured.invoke("Describe Paris.")
    assert isinstance(city, City)


@pytest.mark.parametrize(
    ("tool_choice", "strict"),
    [("required", None), ("GetWeather", None), ("GetWeather", True)],
    ids=["required", "named", "named-strict"],
)
def test_bind_tools_returns_valid_tool_calls(
    smollm2_server: Server, tool_choice: str, strict: bool | None
) -> None:
    """strict=None is langchain's default: the parameters' schemas have no additionalProperties=false,
    and the call must still end (not run to max_tokens). strict=True closes them."""
    llm = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS)
    reply = llm.bind_tools([GetWeather, GetTime], tool_choice=tool_choice, strict=strict).invoke(
        "What is the weather like in Paris?"
    )
    assert isinstance(reply, AIMessage) and reply.tool_calls and not reply.invalid_tool_calls
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    for call in reply.tool_calls:
        assert call["name"] in ("GetWeather", "GetTime") and call["id"]
        {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]].model_validate(call["args"])
    if tool_choice == "GetWeather":
        assert {call["name"] for call in reply.tool_calls} == {"GetWeather"}


def test_streamed_tool_call_chunks_accumulate_to_the_whole_call(smollm2_server: Server) -> None:
    llm = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS).bind_tools(
        [GetWeather, GetTime], tool_choice="GetWeather", parallel_tool_calls=False, strict=True
    )
    question = "What is the weather like in Paris?"
    chunks = list(llm.stream(question))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(len(c.tool_call_chunks) for c in chunks) > 1  # the call arrives in pieces
    streamed = sum(chunks[1:], chunks[0])
    whole = llm.invoke(question)
    assert isinstance(streamed, AIMessageChunk) and not streamed.invalid_tool_calls
    (call,) = streamed.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(call["name"], call["args"])]


def test_tool_result_history_round_trip(smollm2_server: Server) -> None:
    """The agent loop: the model's tool call and a ToolMessage answering it (role tool, tool_call_id)
    go back to the server, which answers in text."""
    llm = _chat(smollm2_server, max_tokens=STRUCTURED_MAX_TOKENS)
    question = HumanMessage("What is the weather like in Paris?")
    call_msg = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke([question])
    (call,) = call_msg.tool_calls
    result = ToolMessage(json.dumps({"temperature": 21, "sky": "sunny"}), tool_call_id=call["id"])
    answer = llm.bind_tools([GetWeather], tool_choice="none").invoke([question, call_msg, result])
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert str(answer.content).strip()
