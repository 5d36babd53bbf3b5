"""`kvserve cluster` settings: flags, the YAML preset's `cluster:` mapping, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.cli import build_parser, cluster_config_from_args, config_from_args, main
from kvserve.cluster.app import check
from kvserve.cluster.config import ClusterConfig, make_cluster_config
from kvserve.config import ServeConfig
from kvserve.errors import ConfigError


def test_flags_override_the_presets_cluster_mapping(tmp_path: Path) -> None:
    preset = tmp_path / "c.yaml"
    preset.write_text("chunk_size: 32\ncluster:\n  replicas: 4\n  load_factor: 2.0\n")
    args = build_parser().parse_args(["cluster", "--config", str(preset), "--replicas", "3"])
    assert cluster_config_from_args(args) == ClusterConfig(replicas=3, load_factor=2.0)
    assert config_from_args(args).chunk_size == 32  # the serve fields still come from the preset


def test_bad_values_and_unknown_keys_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replicas must be >= 1"):
        make_cluster_config(replicas=0)
    with pytest.raises(ConfigError, match="load_factor must be >= 1"):
        make_cluster_config(load_factor=0.5)
    preset = tmp_path / "c.yaml"
    preset.write_text("cluster:\n  replica: 2\n")
    with pytest.raises(ConfigError, match="unknown cluster key.*replica"):
        make_cluster_config(preset)


def test_cluster_flags_are_refused_by_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replicas", "2"]) == 2
    assert "--replicas: only for `kvserve cluster`" in capsys.readouterr().err


def test_the_cluster_needs_the_shared_tier() -> None:
    with pytest.raises(ConfigError, match="--kv-redis-url"):
        check(ServeConfig())
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        check(ServeConfig(enable_prefix_caching=False))
    check(ServeConfig(kv_redis_url="redis://127.0.0.1:6379/0"))


def test_dtype_auto_is_decided_once_for_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32.7: each replica timed its own bf16 / fp32 linears for --dtype auto and could choose
    differently; the driver now decides once and hands every replica the same explicit dtype."""
    from kvserve.cluster.app import replica_config
    from kvserve.config import ServeConfig
    from kvserve.engine import choose

    calls = []

    def decide(name: str, device):  # type: ignore[no-untyped-def]
        calls.append(name)
        return choose.DTYPES["bfloat16"]

    monkeypatch.setattr(choose, "resolve_dtype", decide)
    chosen = replica_config(ServeConfig(device="cpu"))
    assert chosen.dtype == "bfloat16" and calls == ["auto"]
    assert replica_config(ServeConfig(device="cpu", dtype="float32")).dtype == "float32"
    assert calls == ["auto"]  # an explicit dtype is left alone


def test_the_cluster_mappings_values_are_typed_and_finite(tmp_path: Path) -> None:
    """Issue 62.4: the `cluster:` mapping shares load_yaml and had the same unchecked values."""
    cases = [
        ('cluster:\n  replicas: "two"\n', "replicas must be an integer (got 'two', a str)"),
        ("cluster:\n  load_factor: .nan\n", "load_factor must be a finite number (got nan)"),
        ("cluster:\n  routing: 1\n", "routing must be a string (got 1, an int)"),
        ("cluster: 5\n", "`cluster:` must be a mapping of field: value"),
    ]
    preset = tmp_path / "c.yaml"
    for text, message in cases:
        preset.write_text(text)
        with pytest.raises(ConfigError) as info:
            make_cluster_config(preset)
        assert message in info.value.message, (text, info.value.message)
    args = build_parser().parse_args(["cluster", "--replica-cpus", "nan"])
    with pytest.raises(ConfigError, match=r"replica_cpus must be a finite number \(got nan\)"):
        cluster_config_from_args(args)
