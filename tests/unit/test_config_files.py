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


# Issue 62.4: YAML values reached ServeConfig unchecked. `api_key: 12345` made every request with a
# key a 500; `max_queue_size: "lots"` was a traceback from a comparison deep in validate.
@pytest.mark.parametrize(
    "text,message",
    [
        (
            "api_key: 12345",
            'api_key must be a string (got 12345, an int); quote it in YAML: api_key: "12345"',
        ),
        ('max_queue_size: "lots"', "max_queue_size must be an integer (got 'lots', a str)"),
        ("max_queue_size: 2.5", "max_queue_size must be an integer (got 2.5, a float)"),
        ("max_queue_size: true", "max_queue_size must be an integer (got True, a bool)"),
        ("enable_prefix_caching: 1", "enable_prefix_caching must be true or false (got 1, an int)"),
        ('enable_prefix_caching: "no"', "enable_prefix_caching must be true or false (got 'no', a str)"),
        ("request_timeout_s: true", "request_timeout_s must be a number (got True, a bool)"),
        ("request_timeout_s: .nan", "request_timeout_s must be a finite number (got nan)"),
        ("audit_rate: .inf", "audit_rate must be a finite number (got inf)"),
        ("model: null", "model must be a string (got None, null)"),
        ("model: [a]", "model must be a string (got ['a'], a list)"),
        ("warm: 5", "warm must be a list of strings (got 5, an int)"),
        ("warm: [a, 3]", "warm must be a list of strings"),
    ],
)
def test_yaml_values_must_have_the_fields_type(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "typed.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        make_config(path)
    assert info.value.message.startswith(message), info.value.message
    assert info.value.param == text.split(":")[0]


def test_yaml_values_of_the_right_type_are_taken_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text('api_key: "12345"\nrequest_timeout_s: 30\nenable_prefix_caching: off\nwarm: one\n')
    cfg = make_config(path)
    assert (cfg.api_key, cfg.request_timeout_s, cfg.enable_prefix_caching) == ("12345", 30, False)
    assert cfg.warm == ("one",)


def test_a_missing_unreadable_or_broken_file_is_one_line_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: tiny-random-llama\nport: [8000\nhost: x\n")
    cases = [
        (tmp_path / "missing.yaml", f"config file {tmp_path / 'missing.yaml'} not found"),
        (tmp_path, f"config file {tmp_path} cannot be read (Is a directory)"),
        (broken, f"config file {broken} is not valid YAML: line 3, column 5:"),
    ]
    for path, message in cases:
        with pytest.raises(ConfigError) as info:
            make_config(path)
        assert info.value.message.startswith(message), info.value.message
        assert "\n" not in info.value.message


def test_every_field_is_in_exactly_one_slice_with_the_configs_value():
    import dataclasses

    from kvserve.config_slices import SLICES

    owners: dict[str, list[str]] = {}
    for kind in SLICES:
        for f in dataclasses.fields(kind):
            owners.setdefault(f.name, []).append(kind.__name__)
    assert {name: len(kinds) for name, kinds in owners.items() if len(kinds) != 1} == {}
    assert set(owners) == {f.name for f in dataclasses.fields(ServeConfig)}
    config = ServeConfig(block_size=32, chunk_size=64, reuse="any", kv_redis_url="redis://h:1/0")
    assert config.cache_config.block_size == 32 and config.cache_config.chunk_size == 64
    assert config.reuse_config.reuse == "any" and config.tier_config.kv_redis_url == "redis://h:1/0"
    assert config.replace(block_size=16).cache_config.block_size == 16  # a new config, its own slices
