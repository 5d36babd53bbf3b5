"""Tool calling: the request's checks, the grammar that enforces `required` and named tool choices,
and the parser that turns generated text into OpenAI `tool_calls` (whole responses and streams).

How each `tool_choice` generates and parses (vLLM's approach):

| tool_choice | generation | the output is parsed as |
|---|---|---|
| `none` | free (tools are still rendered, so the prompt shares its prefix with `auto`) | text |
| `auto` | free | <tool_call> JSON blocks (kvserve.tokenizer's Hermes format) -> calls, the rest text |
| named | constrained to the function's `parameters` schema | that call's arguments |
| `required` | constrained to a JSON array of `{"name", "arguments"}` calls (anyOf per tool) | calls |

One parser (ToolCallStream) serves both shapes: a whole response is the stream fed all at once."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.api.protocol import ChatCompletionRequest, ChatMessage, Tool
from kvserve.errors import InvalidRequestError
from kvserve.request import StructuredOutput
from kvserve.structured.items import ArrayItems
from kvserve.tokenizer import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's output becomes tool calls; None (no ToolCalling) = plain text."""

    mode: Literal["auto", "named", "required"]
    names: tuple[str, ...]  # the request's function names
    parallel: bool  # parallel_tool_calls: false keeps the first call only
    structured: StructuredOutput | None = None  # the grammar (named and required)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def tool_calling(body: ChatCompletionRequest) -> ToolCalling | None:
    """The request's tool calling, checked: 400s name tools or tool_choice. None when nothing is
    parsed (no tools, or tool_choice none)."""
    tools = body.tools or []
    names = tuple(t.function.name for t in tools)
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise InvalidRequestError(
            f"tools: two functions are named {duplicate!r}; give each function its own name", param="tools"
        )
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(
            f"tool_choice {_choice_text(choice)} needs tools; send tools or drop tool_choice",
            param="tool_choice",
        )
    if choice == "auto":
        return ToolCalling("auto", names, body.parallel_tool_calls)
    if getattr(body, "response_format", None) is not None:
        raise InvalidRequestError(
            f"tool_choice {_choice_text(choice)} and response_format both constrain the output; "
            "send one of them",
            param="tool_choice",
        )
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls)
        return ToolCalling("required", names, body.parallel_tool_calls, _structured(schema))
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})",
            param="tool_choice",
        )
    tool = tools[names.index(name)]
    return ToolCalling("named", (name,), body.parallel_tool_calls, _structured(_parameters(tool)))


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """What `required` generates: a JSON array of calls, each {"name": one tool's name,
    "arguments": that tool's parameters}; one call at most when `parallel` is false."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _structured(schema: dict[str, Any]) -> StructuredOutput:
    # keys keep their order: "name" comes before "arguments" (a model picks the function, then fills
    # it in); required's array: a small model repeats its last call until max_tokens, a repeat ends it
    repeats = schema.get("type") == "array"
    return StructuredOutput.of_schema(schema, source="tools", stop_on_repeated_item=repeats)


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Tool-calling fields where they belong: `tool_calls` on assistant messages only (content may
    then be null), `tool_call_id` on `tool` messages only (and required there)."""
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                param=f"messages.{i}.tool_calls",
            )
        if (m.role == "tool") != (m.tool_call_id is not None):
            what = (
                "needs a tool_call_id (the id of the call it answers)"
                if m.role == "tool"
                else ("tool_call_id belongs on role tool messages only")
            )
            raise InvalidRequestError(f"messages[{i}] {what}", param=f"messages.{i}.tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequestError(
                f"messages[{i}].content is missing: only an assistant message with tool_calls may omit it",
                param=f"messages.{i}.content",
            )


@dataclass
class ToolDelta:
    """What a piece of output adds: text, and OpenAI tool_calls delta entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: ToolDelta) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


class ToolCallStream:
    """Parses one choice's output as it arrives (feed, then finish once).

    auto: text outside <tool_call> blocks is content, never a block's text or what may be the start
    of one (held back). A block whose JSON has a known `name` and an object `arguments` becomes a
    call, delivered whole when it closes (or at the end, unclosed); any other block stays text.
    Whitespace next to a call is dropped. named: every piece of text is an `arguments` piece of
    call 0. required: each complete item of the JSON array is a call; if none completes (cut by
    max_tokens), the text is content. With parallel false only the first call is kept."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.num_calls = 0
        self._text = ""  # auto: undecided text; required: everything so far
        self._in_block = False
        self._ws = ""  # auto: trailing whitespace held until text follows it
        self._ws_before_block = ""
        self._after_call = False
        self._array = ArrayItems()  # required: the array's items as they complete
        self._made: set[tuple[str, str]] = set()  # (name, arguments) of the calls made

    def feed(self, text: str) -> ToolDelta:
        if self.calling.mode == "named":
            return self._named(text)
        if self.calling.mode == "required":
            return self._required(text)
        return self._auto(text)

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        mode = self.calling.mode
        if mode == "named" and self.num_calls == 0:
            out.add(self._named("", force=True))
        elif mode == "required" and self.num_calls == 0:
            out.content = self._text
        elif mode == "auto":
            if self._in_block:  # unclosed at the end: a call if its JSON is complete
                self._block(self._text, TOOL_CALL_OPEN + self._text, out)
            else:
                out.content += self._content(self._text)
            out.content += "" if self._after_call else self._ws
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for a generation that stopped normally after making calls."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _call(self, name: str, arguments: str) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        return {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _named(self, text: str, force: bool = False) -> ToolDelta:
        if self.num_calls:
            return ToolDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])
        if not (text or force):
            return ToolDelta()
        return ToolDelta(tool_calls=[self._call(self.calling.names[0], text)])

    def _parsed_call(self, text: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of `{"name": <a known function>, "arguments": {...}}`, else None."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.calling.names:
            return None
        if not isinstance(value.get("arguments"), dict):
            return None
        return value["name"], json.dumps(value["arguments"], ensure_ascii=False)

    def _keep(self, parsed: tuple[str, str], out: ToolDelta) -> None:
        """A parsed call is made unless it repeats an earlier one (a model's loop, which ends a
        `required` generation: StructuredOutput.stop_on_repeated_item) or parallel calls are off
        and one was made."""
        if parsed not in self._made and (self.calling.parallel or self.num_calls == 0):
            out.tool_calls.append(self._call(*parsed))
            self._made.add(parsed)
        self._after_call = True

    # --- required: items of a JSON array -------------------------------------------------------
    def _required(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self._text += text
        for item in self._array.feed(self._text):
            parsed = self._parsed_call(item)
            if parsed is not None:
                self._keep(parsed, out)
        return out

    # --- auto: <tool_call> blocks in free text -------------------------------------------------
    def _auto(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self._text += text
        while True:
            if not self._in_block:
                at = self._text.find(TOOL_CALL_OPEN)
                if at < 0:
                    keep = _partial_tag(self._text, TOOL_CALL_OPEN)
                    out.content += self._content(self._text[: len(self._text) - keep])
                    self._text = self._text[len(self._text) - keep :]
                    return out
                out.content += self._content(self._text[:at])
                self._ws_before_block, self._ws = self._ws, ""
                self._text = self._text[at + len(TOOL_CALL_OPEN) :]
                self._in_block = True
            else:
                at = self._text.find(TOOL_CALL_CLOSE)
                if at < 0:
                    return out
                body = self._text[:at]
                self._text = self._text[at + len(TOOL_CALL_CLOSE) :]
                self._block(body, TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, out)

    def _block(self, body: str, raw: str, out: ToolDelta) -> None:
        self._in_block = False
        parsed = self._parsed_call(body)
        if parsed is None:
            out.content += self._content(self._ws_before_block + raw)
        else:
            self._keep(parsed, out)

    def _content(self, text: str) -> str:
        """Text outside calls, less trailing whitespace (held in _ws until text follows)."""
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept) :]
        if self._after_call:
            kept = kept.lstrip()
            self._after_call = not kept
        return kept


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def message(calling: ToolCalling, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole response's assistant message and finish reason: content (null when empty) and, when
    calls were made, tool_calls in the OpenAI shape."""
    stream = calling.stream()
    delta = stream.feed(text)
    delta.add(stream.finish())
    body: dict[str, Any] = {"role": "assistant", "content": delta.content or None}
    calls = merge_tool_call_deltas(delta.tool_calls)
    if calls:
        body["tool_calls"] = calls
    return body, stream.finish_reason(reason)


def merge_tool_call_deltas(deltas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool_calls deltas accumulated into whole calls (what a client does)."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d["index"] == len(calls):
            calls.append({k: v for k, v in d.items() if k != "index"})
            calls[-1]["function"] = dict(d["function"])
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def delta_body(stream: ToolCallStream, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed chunk's delta and finish reason for `text` (the chunk's new text); `reason` not
    None ends the choice."""
    delta = stream.feed(text)
    if reason is not None:
        delta.add(stream.finish())
        reason = stream.finish_reason(reason)
    body: dict[str, Any] = {}
    if delta.content:
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = delta.tool_calls
    return body, reason
