"""Tokenizer wrapper: encode, chat template, and an incremental detokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError

VALID_ROLES = ("system", "developer", "user", "assistant")


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_str(self, token_id: int) -> str:
        return str(self.hf.decode([token_id]))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render messages with the model's chat template. Content may be a string or a list of
        text parts; `developer` is rendered as `system`."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        rendered = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in VALID_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role must be one of {', '.join(VALID_ROLES)} (got {role!r})",
                    param="messages",
                )
            rendered.append({"role": "system" if role == "developer" else role, "content": _text_of(m, i)})
        if self.hf.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in rendered)
            return self.encode(text + ("assistant: " if add_generation_prompt else ""))
        ids = self.hf.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


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
    if content is None and message.get("role") == "assistant":
        return ""
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a small window [prefix_offset, len) and emits what goes beyond [prefix_offset, read_offset),
    holding back text that ends in the replacement character (an incomplete byte sequence)."""

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail[-6:])  # context for tokenizers that merge spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
