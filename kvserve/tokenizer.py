"""Tokenizer wrapper: encode, chat template, and an incremental detokenizer."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from kvserve.errors import InvalidRequestError

VALID_ROLES = ("system", "developer", "user", "assistant", "tool")

# Tool calling for chat templates that do not render tools (their text never uses `tools`, e.g.
# SmolLM2's ChatML): the Hermes / Qwen2.5 format. The tools are listed in the system message, the
# model answers a call as a <tool_call> block, and tool results come back as a user turn of
# <tool_response> blocks. kvserve/api/tools.py parses the blocks out of the output.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class Tokenizer:
    """The model's Hugging Face tokenizer behind one lock. Three threads use it: the engine thread
    detokenizes, the server's tokenizer thread encodes and renders chat templates, the event loop asks
    for token strings (logprobs). Every call into `hf` takes the lock, so the rule holds whatever a
    tokenizers release does with the GIL (today a fast tokenizer's encode holds it anyway, so the lock
    adds no waiting: a long encode already paused the engine's decodes); llguidance gets its own copy
    of the vocabulary at start-up and never calls back."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        """Pickled without its lock (a cluster replica sends its Tokenizer to the ingress): the lock
        guards this process's threads, so the copy gets a new one."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools itself (else: the Hermes fallback, hermes_messages)."""
        return _template_uses_tools(self.hf.chat_template)

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone (no special tokens added: a rendered chat template has its own)."""
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's tokens (completions, /tokenize, warm texts) with the special tokens the
        model's tokenizer adds, as transformers and vLLM do: Gemma's <bos>, which the model needs in
        front; nothing for SmolLM2 or Qwen2, whose tokenizers add none."""
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, prompt_tail: Sequence[int]) -> DecodeStream | None:
        """A DecodeStream primed with `prompt_tail` (special tokens skipped, as `decode` does), or None
        when the HF tokenizer has no fast (Rust) backend to step it with."""
        if getattr(self.hf, "backend_tokenizer", None) is None:
            return None
        return DecodeStream(list(prompt_tail), True)

    def step(self, stream: DecodeStream, token_id: int) -> str:
        """The text `token_id` completes in `stream` ("" while a character is split across tokens)."""
        with self._lock:
            return stream.step(self.hf.backend_tokenizer, token_id) or ""

    def token_str(self, token_id: int) -> str:
        with self._lock:
            return str(self.hf.decode([token_id]))

    def token_texts(self) -> list[str]:
        """Every token's text, decoded alone (index = id), special tokens included."""
        with self._lock:
            return [str(t) for t in self.hf.batch_decode([[i] for i in range(self.vocab_size)])]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render messages with the model's chat template. Content may be a string or a list of
        text parts; `developer` is rendered as `system`. `tools` (OpenAI tool definitions), assistant
        `tool_calls` and `tool` messages go through the template when it renders tools, else through
        the Hermes fallback (hermes_messages)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        rendered = [_template_message(m, i) for i, m in enumerate(messages)]
        if not self.renders_tools:
            rendered, tools = hermes_messages(rendered, tools), None
        if self.hf.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in rendered)
            return self.encode_prompt(text + ("assistant: " if add_generation_prompt else ""))
        with_tools: dict[str, Any] = {"tools": tools} if tools else {}
        with self._lock:
            ids = self.hf.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, tokenize=True, **with_tools
            )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _template_uses_tools(template: Any) -> bool:
    """Whether a chat template (a string, or a dict of named templates) reads `tools`."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(re.search(r"\btools\b", str(text)) for text in texts)


def _template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as chat templates read it: text content, the role checked, tool-call arguments
    as objects where they are JSON objects (what templates with tool support expect)."""
    role = message.get("role")
    if role not in VALID_ROLES:
        raise InvalidRequestError(
            f"messages[{index}].role must be one of {', '.join(VALID_ROLES)} (got {role!r})",
            param="messages",
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _text_of(message, index)
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tool calling as plain messages (templates without tool support): the tools (one JSON line
    each) in TOOLS_SYSTEM_PROMPT, appended to the first system message or as a new one; an
    assistant's tool_calls as <tool_call> blocks after its content; each run of `tool` messages as
    one user turn of <tool_response> blocks."""
    out: list[dict[str, Any]] = []
    previous_role = None
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            calls = "\n".join(
                f"{TOOL_CALL_OPEN}\n{json.dumps(c['function'], ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                for c in m["tool_calls"]
            )
            out.append({"role": role, "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": role, "content": content})
        previous_role = role
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = TOOLS_SYSTEM_PROMPT.format(tools=listing)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _text_of(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None and message.get("role") == "assistant":  # with tool_calls
        return ""
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    With a fast (Rust) tokenizer: tokenizers' DecodeStream, which buffers the bytes of a character
    split across tokens. Otherwise (and as the reference the stream is tested against,
    `window=True`): decodes the window of ids not yet emitted after the last emitted delta's ids,
    and emits what goes beyond the text of those already emitted, holding back text that ends in the
    replacement character. Either way the last few prompt tokens are context, for tokenizers that
    merge spaces; a delta costs the same at any length of the output."""

    CONTEXT = 6  # prompt tokens of context

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = (), window: bool = False):
        self.tokenizer = tokenizer
        context = list(prompt_tail[-self.CONTEXT :])
        self._stream = None if window else tokenizer.decode_stream(context)
        self.ids: list[int] = context  # the window: the last emitted delta's ids, then the pending ones
        self.read_offset = len(self.ids)  # ids before it were emitted

    def add(self, token_id: int) -> str:
        if self._stream is not None:
            return self.tokenizer.step(self._stream, token_id)
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[: self.read_offset])
        new_text = decode(self.ids)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            del self.ids[: self.read_offset]  # only the window is read again
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""
