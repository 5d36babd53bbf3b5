"""Config values checked against their fields' declared types (ServeConfig and the cluster's config).

YAML and keyword arguments arrive unconverted, so `api_key: 12345` is an int and `max_queue_size: "lots"`
a string: `check_types` names the field, the value and the type it expected."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from typing import Any

from kvserve.errors import ConfigError


def check_types(config: Any) -> None:
    """Raise ConfigError for a field of the dataclass `config` whose value is not of its declared
    type, or a float that is not finite. YAML and keyword arguments arrive unconverted
    (`api_key: 12345` is an int): bool takes only true / false, int no bool, float no bool and
    no nan or inf, str only a string, `X | None` also null, Literal only its values."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, expected = getattr(config, f.name), hints[f.name]
        if not _is_a(value, expected):
            quote = (
                f'; quote it in YAML: {f.name}: "{value}"' if expected is str and _is_scalar(value) else ""
            )
            raise ConfigError(
                f"{f.name} must be {_describe(expected)} (got {value!r}, {_kind(value)}){quote}",
                param=f.name,
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number (got {value})", param=f.name)


def _is_a(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return isinstance(value, tuple) and all(_is_a(v, args[0]) for v in value)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_is_a, value, args))
    if origin in (list, set, frozenset):
        return isinstance(value, origin) and all(_is_a(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _is_a(k, args[0]) and _is_a(v, args[1]) for k, v in value.items()
        )
    return isinstance(value, origin or tp)


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is None or tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list, set, frozenset) and args:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    return _NAMES.get(tp, f"a {getattr(origin or tp, '__name__', tp)}")


def _kind(value: Any) -> str:
    name = type(value).__name__
    return "null" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float))
