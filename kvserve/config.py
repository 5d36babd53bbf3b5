"""ServeConfig: the one frozen configuration value, its YAML loading and its validation.

Precedence: field defaults < YAML preset (`config=FILE`) < keyword arguments / CLI flags.
Field name == CLI flag (with dashes) == YAML key. Runtime facts (number of blocks found at start-up,
eos ids, chosen backend) live in `engine.RuntimeInfo`, never here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from kvserve.config_slices import (
    SLICES,
    CacheConfig,
    ModelConfig,
    ReuseConfig,
    SchedulerConfig,
    ServerConfig,
    TierConfig,
)
from kvserve.config_types import check_types
from kvserve.errors import ConfigError

S = TypeVar("S")


# the fields in the order users read them (--help): a dataclass takes its bases' fields from the last
@dataclass(frozen=True)
class ServeConfig(ServerConfig, SchedulerConfig, ReuseConfig, TierConfig, CacheConfig, ModelConfig):
    """Every field of every slice (config_slices/), flat: what users write and what the engine reads."""

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **overrides: Any) -> ServeConfig:
        return from_dict({**dataclasses.asdict(self), **overrides})

    # --- each part's slice (config_slices/) ---------------------------------------------------------
    def slice(self, kind: type[S]) -> S:
        """Slice `kind` (a dataclass of config_slices/) with this config's values: only its fields."""
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})  # type: ignore[arg-type]

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return self.slice(ModelConfig)

    @functools.cached_property
    def cache_config(self) -> CacheConfig:
        return self.slice(CacheConfig)

    @functools.cached_property
    def tier_config(self) -> TierConfig:
        return self.slice(TierConfig)

    @functools.cached_property
    def reuse_config(self) -> ReuseConfig:
        return self.slice(ReuseConfig)


def validate(cfg: ServeConfig) -> None:
    """Raise ConfigError naming the field and the fix: the types, each slice's own checks, then the
    checks that span slices."""
    check_types(cfg)
    for kind in SLICES:
        kind.check(cfg)
    if cfg.max_num_batched_tokens < cfg.block_size:
        raise ConfigError(
            f"max_num_batched_tokens must be at least block_size (got {cfg.max_num_batched_tokens})"
        )
    if cfg.tier_config.configured and not cfg.enable_prefix_caching:
        raise ConfigError(
            "the KV tiers (kv_cold_bytes, kv_disk_dir, kv_redis_url) need enable_prefix_caching"
        )


def field_names() -> list[str]:
    return [f.name for f in fields(ServeConfig)]


def from_dict(values: dict[str, Any]) -> ServeConfig:
    """Build a config from a mapping; unknown keys are errors."""
    known = set(field_names())
    unknown = sorted(str(key) for key in set(values) - known)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    values = dict(values)
    warm = values.get("warm")
    if isinstance(warm, str):
        values["warm"] = (warm,)
    elif warm is None or isinstance(warm, list):  # anything else is left for check_types to name
        values["warm"] = tuple(warm or ())
    return ServeConfig(**values)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file `path`. A file that is missing, unreadable or not YAML is a
    one-line ConfigError naming it (and, for a syntax error, the line and column)."""
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"config file {path} cannot be read ({reason})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of field: value")
    return data


def _yaml_problem(error: Exception) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def make_config(config_file: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """defaults < YAML preset < overrides. The preset's `cluster:` mapping is `kvserve cluster`'s
    (kvserve/cluster/config.py)."""
    values: dict[str, Any] = load_yaml(config_file) if config_file else {}
    values.pop("cluster", None)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(values)
