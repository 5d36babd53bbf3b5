"""configs/*.yaml: default.yaml mirrors ServeConfig exactly; every preset loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from kvserve.config import ServeConfig, field_names, make_config
from kvserve.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _yaml_value(default: object) -> object:
    return list(default) if isinstance(default, tuple) else default


def test_default_yaml_lists_every_field_with_its_default_in_order() -> None:
    data = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert list(data) == field_names()
    for f in dataclasses.fields(ServeConfig):
        assert data[f.name] == _yaml_value(f.default), f.name
    assert make_config(CONFIGS / "default.yaml") == ServeConfig()


def test_default_yaml_comments_every_key() -> None:
    lines = (CONFIGS / "default.yaml").read_text().splitlines()
    keys = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    assert len(keys) == len(field_names())
    for i in keys:
        assert lines[i - 1].startswith("# ") and len(lines[i - 1]) > 3, lines[i]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(path: Path) -> None:
    cfg = make_config(path)
    assert isinstance(cfg, ServeConfig)


def test_presets_exist() -> None:
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"default.yaml", "cpu-smollm2.yaml", "gpu.yaml"} <= names


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny-random-llama\nmax_cache_byte: 10\n")
    with pytest.raises(ConfigError, match="max_cache_byte"):
        make_config(path)


def test_optional_extras_pull_only_what_their_feature_needs():
    """Issue 32.7: the redis and cluster extras pulled in selenium (the dashboard's browser test)."""
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name in ("redis", "cluster", "triton", "bench"):
        assert not any(dep.startswith("selenium") for dep in extras[name]), name
    assert any(dep.startswith("selenium") for dep in extras["test"])
