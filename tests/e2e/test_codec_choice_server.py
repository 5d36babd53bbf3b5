"""Issue 38: the codec a bit budget gets, and its measured task loss, are said at start-up and in
/v1/stats `config`; the cold tier's `auto` codec is chosen by the same rule."""

from __future__ import annotations

from pathlib import Path

from kvserve.quant.choice import choose_codec
from tests.e2e.conftest import TINY_FLAGS, launch, stop


def test_a_bit_budget_reports_the_codec_it_chose_and_its_measured_loss(tmp_path: Path):
    server = launch(tmp_path, *TINY_FLAGS, "--kv-cache-bits", "3", "--kv-cold-bytes", "4000000")
    try:
        config = server.stats()["config"]
        log = server.log()
    finally:
        stop(server)
    # tiny-random-llama: 2 KV heads x head_dim 16, blocks of 16
    want, cold = choose_codec(3, 2, 16, 16), choose_codec(None, 2, 16, 16)
    quality = config["kv_codec_quality"]
    assert config["kv_codec_chosen"] == want.codec == quality["codec"] and config["kv_cache_bits"] == 3
    assert quality["meets_target"] == want.meets and quality["task_accuracy_x_bf16"] == want.accuracy
    assert "smollm2-135m" in quality["task_accuracy_x_bf16"] and "lookup prompts" in quality["source"]
    assert f"KV codec for --kv-cache-bits 3: {want.codec}" in log
    if not want.meets:  # the loss is said where it is chosen
        assert "NO codec within 3 bits" in log and f"loses {1 - want.worst:.0%}" in log
    assert config["kv_cold_codec"] == "auto" and config["kv_cold_codec_chosen"] == cold.codec
    assert config["kv_cold_codec_quality"]["budget_bits"] is None
    assert f"KV codec for the cold tier: {cold.codec}" in log
