"""The one check of a field that takes one of a few names."""

from __future__ import annotations

from typing import Any

from kvserve.errors import ConfigError


def choose(config: Any, name: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless `config`'s field `name` is one of `choices`."""
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
