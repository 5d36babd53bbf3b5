"""What every request body's model is made of: strict types (`"5"` is not an integer, `true` is not a
token id), numbers inside their documented range (kvserve.request.RANGES, also stated in the OpenAPI
document), unknown fields refused, and no string holding a lone UTF-16 surrogate (JSON allows
"\\ud800"; no tokenizer, hash or response can carry it). The request models are protocol.py's."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvserve.request import RANGES

TOKEN_ID_MARK = "x-kvserve-token-id"  # the OpenAPI document bounds these by the served vocabulary

TokenId = Annotated[int, Field(json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def ranged(name: str, description: str = "", default: Any = None) -> Any:
    """A parameter limited to RANGES[name] (validated here and stated in the OpenAPI document)."""
    r = RANGES[name]
    return Field(
        default=default,
        description=f"{description} Range {r}.".strip(),
        gt=r.low if r.low_open else None,
        ge=None if r.low_open else r.low,
        le=r.high,
    )


def bounded(name: str) -> Any:
    """RANGES[name] as Annotated metadata (for the values of a dict)."""
    r = RANGES[name]
    return Field(gt=r.low if r.low_open else None, ge=None if r.low_open else r.low, le=r.high)


def first_surrogate(value: Any) -> int | None:
    """Index of the first lone surrogate in a string, or in the strings inside lists and dicts."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return match.start() if match else None
    if isinstance(value, (dict, list)) and value and _surrogate_free(value):
        return None  # the usual case, found at C speed: walking a 400 KB schema in Python takes 0.1 s
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list) and value and not isinstance(value[0], int):  # token ids: skip
        for item in value:
            found = first_surrogate(item)
            if found is not None:
                return found
    return None


SURROGATE_FREE = "surrogate_free"  # validation context key: the body's text holds no surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def no_surrogates(raw: bytes) -> bool:
    """True when no string parsed from this JSON body can hold a surrogate: the body is ASCII (so a
    surrogate could only come as a \\udXXX escape) and has no such escape. 0.3 ms for 400 KB, against
    4 ms for walking the parsed body (a literal backslash before "ud8" says False: then walk it)."""
    return raw.isascii() and _SURROGATE_ESCAPE.search(raw) is None


def _surrogate_free(value: dict[Any, Any] | list[Any]) -> bool:
    """True when no string inside holds a surrogate: ASCII JSON escapes every surrogate as "\\udXXX"
    (False also for a paired one, an emoji, or a literal backslash before "ud": then walk it)."""
    try:
        return "\\ud" not in json.dumps(value)
    except (TypeError, ValueError):  # not JSON data: walk it
        return False


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    # what a body of this kind must hold, for the message when it is missing
    expects: ClassVar[str] = "a JSON object"


class Body(Strict):
    """A request body. Its fields are checked for lone surrogates here, each once with what it
    holds: the models inside a body are only ever validated as part of it (checked at every level,
    a 600 KB json_schema cost 35 ms of event loop)."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(SURROGATE_FREE):  # the raw body was checked (no_surrogates)
            return value
        at = first_surrogate(value)
        if at is not None:
            raise PydanticCustomError(
                "unicode_surrogate",
                "{field} contains a lone UTF-16 surrogate (character {at}); send valid Unicode text",
                {"field": info.field_name, "at": at},
            )
        return value
