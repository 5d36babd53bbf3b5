"""`kvserve cluster` settings: the ServeConfig every replica runs, plus these. Field name == flag with
dashes == key of the YAML preset's `cluster:` mapping, as for ServeConfig."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvserve.config import load_yaml
from kvserve.config_types import check_types
from kvserve.errors import ConfigError


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = field(default=2, metadata={"help": "engine replicas (each loads the model)"})
    address: str = field(
        default="",
        metadata={
            "help": "Ray cluster to deploy on ('auto', 'ray://HOST:10001'); empty: start Ray on this machine"
        },
    )
    replica_cpus: float = field(
        default=1.0, metadata={"help": "CPUs Ray reserves for each replica (also its torch threads)"}
    )
    routing: str = field(
        default="prefix-affinity",
        metadata={"help": "prefix-affinity or round-robin (the baseline: every replica in turn)"},
    )
    affinity_chunks: int = field(
        default=1, metadata={"help": "prompt chunks whose prefix hash picks the replica"}
    )
    load_factor: float = field(
        default=1.5,
        metadata={"help": "bounded load: above this times the mean load, go to the least-loaded replica"},
    )
    min_load: int = field(
        default=8,
        metadata={"help": "bounded load applies from this many requests in flight on a replica"},
    )


ROUTING = ("prefix-affinity", "round-robin")


def validate(c: ClusterConfig) -> None:
    check_types(c)
    if c.routing not in ROUTING:
        raise ConfigError(f"routing must be one of {', '.join(ROUTING)} (got {c.routing!r})")
    if c.replicas < 1:
        raise ConfigError(f"replicas must be >= 1 (got {c.replicas})")
    if c.replica_cpus <= 0:
        raise ConfigError(f"replica_cpus must be positive (got {c.replica_cpus})")
    if c.affinity_chunks < 1:
        raise ConfigError(f"affinity_chunks must be >= 1 (got {c.affinity_chunks})")
    if c.load_factor < 1.0 or c.min_load < 0:
        raise ConfigError(f"load_factor must be >= 1 and min_load >= 0 (got {c.load_factor}, {c.min_load})")


def make_cluster_config(config_file: str | Path | None = None, **overrides: Any) -> ClusterConfig:
    """defaults < the YAML preset's `cluster:` mapping < overrides."""
    preset = load_yaml(config_file).get("cluster") if config_file else None
    if not isinstance(preset or {}, dict):
        raise ConfigError(f"{config_file}: `cluster:` must be a mapping of field: value")
    values: dict[str, Any] = dict(preset or {})
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(ClusterConfig)}
    unknown = sorted(str(key) for key in set(values) - known)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"unknown cluster key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    config = ClusterConfig(**values)
    validate(config)
    return config
