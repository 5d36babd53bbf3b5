"""kvserve's flags are generated from ServeConfig; precedence defaults < --config < flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvserve.cli import build_parser, config_from_args
from kvserve.config import ServeConfig
from kvserve.errors import ConfigError
from kvserve.serving import describe


def _config(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_help_documents_every_field_with_its_default() -> None:
    text = " ".join(build_parser().format_help().split())
    for f in dataclasses.fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert f"(default: {f.default!r})" in text, f.name


def test_no_flags_gives_the_defaults() -> None:
    assert _config() == ServeConfig()
    assert _config("serve") == ServeConfig()


def test_flags_are_typed_and_override_the_preset(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("model: tiny-random-llama\nport: 9000\nmax_queue_size: 7\nwarm: [a]\n")
    cfg = _config("--config", str(preset), "--port", "9100", "--request-timeout-s", "2.5")
    assert (cfg.model, cfg.port, cfg.max_queue_size, cfg.request_timeout_s) == (
        "tiny-random-llama",
        9100,
        7,
        2.5,
    )
    assert cfg.warm == ("a",)


def test_warm_is_repeatable_and_booleans_have_no_form() -> None:
    cfg = _config("--warm", "one", "--warm", "two", "--no-enable-prefix-caching")
    assert cfg.warm == ("one", "two")
    assert cfg.enable_prefix_caching is False


def test_bad_values_are_errors() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        _config("--chunk-size", "24")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "eighty"])
    with pytest.raises(ConfigError, match="kv_cache_bits must be 16, 8, 4, 3 or 2"):
        _config("--kv-cache-bits", "5")
    assert _config("--kv-cache-bits", "2").kv_cache_bits == 2
    with pytest.raises(ConfigError, match="kv_decoded_bytes must be >= 0 and below max_cache_bytes"):
        _config("--kv-decoded-bytes", "-1")
    with pytest.raises(ConfigError, match="kv_decoded_bytes"):
        _config("--max-cache-bytes", "1000", "--kv-decoded-bytes", "1000")


def test_describe_names_the_choices() -> None:
    class Info:
        model_path, device, dtype, kv_codec, attention_backend = "/m", "cpu", "float32", "fp32", "cpu_paged"
        model_forward = "fused"
        num_layers, num_kv_heads, head_dim, num_blocks, block_size = 4, 2, 16, 10, 16
        bytes_per_token, max_model_len, pool_tokens = 1024.0, 4096, 160
        kv_layout = "one group of 4 layers"
        kv_decoded_bytes = 0

    class QuantizedInfo(Info):
        kv_codec, kv_decoded_bytes = "int4", 2**20

    text = describe(ServeConfig(model="tiny-random-llama"), Info())
    assert "decoded" not in text
    kept = describe(ServeConfig(model="tiny-random-llama", kv_decoded_bytes=2**20), Info())
    assert "kv_decoded_bytes unused: the fp32 pool holds values attention reads as they are" in kept
    kept = describe(ServeConfig(model="tiny-random-llama", kv_decoded_bytes=2**20), QuantizedInfo())
    assert "decoded blocks kept across steps: up to 1.0 MiB" in kept
    for word in (
        "tiny-random-llama",
        "cpu",
        "float32",
        "fp32",
        "cpu_paged",
        "model forward fused",
        "160 tokens",
        "1024 bytes/token",
        "KV layout: one group of 4 layers",
    ):
        assert word in text


def test_main_reports_a_bad_config_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.cli import main

    assert main(["--block-size", "12"]) == 2
    assert "block_size must be a positive power of two" in capsys.readouterr().err


FLOAT_FIELDS = [f.name for f in dataclasses.fields(ServeConfig) if f.type in ("float", float)]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_flag_must_be_finite(name: str) -> None:
    """Issue 62.4: `--request-timeout-s nan` was taken and turned every timeout off (`nan <= 0` is
    false), and so for every range check of a float field."""
    flag = "--" + name.replace("_", "-")
    for text in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match=rf"^{name} must be a finite number \(got {text}\)$"):
            _config(f"{flag}={text}")
    with pytest.raises(ConfigError, match=f"{name} must be a finite number"):
        ServeConfig(**{name: float("nan")})


@pytest.mark.parametrize(
    "yaml_text,message",
    [
        (
            "api_key: 12345\n",
            'kvserve: error: api_key must be a string (got 12345, an int); quote it in YAML: api_key: "12345"',
        ),
        ('max_queue_size: "lots"\n', "kvserve: error: max_queue_size must be an integer (got 'lots', a str)"),
        (
            "model: [\n",
            "kvserve: error: config file {path} is not valid YAML: line 2, column 1: expected the node content",
        ),
        (None, "kvserve: error: config file {path} not found"),
    ],
)
def test_main_reports_a_bad_config_file_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    yaml_text: str | None,
    message: str,
) -> None:
    from kvserve import cli

    def serve(config: ServeConfig, log_level: str) -> None:
        raise AssertionError(f"a bad config was served: {config}")

    monkeypatch.setattr(cli, "serve", serve)
    path = tmp_path / "preset.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(path=path)) and err.count("\n") == 1, err
