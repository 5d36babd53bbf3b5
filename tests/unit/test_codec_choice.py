"""--kv-cache-bits and the cold tier choose a codec by measured task accuracy per byte (issue 38)."""

import json

import pytest

from kvserve.errors import ConfigError
from kvserve.quant import choice
from kvserve.quant.choice import TARGET, choose_codec, codec_quality, measured_accuracy
from kvserve.quant.registry import CODEC_NAMES


def lookup(x_reference: dict[str, float]) -> dict:
    """A lookup run whose reference (bf16) answered every prompt: accuracy == x bf16."""
    return {
        "lookup": {
            "prompts": 200,
            "reference": "bf16",
            "source": "test",
            "accuracy": x_reference,
            "x_reference": x_reference,
        }
    }


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Write an accuracy file ({model: {codec: x bf16}}) and point the chooser at it."""

    def write(models: dict[str, dict[str, float]]) -> None:
        path = tmp_path / "codec_accuracy.json"
        path.write_text(json.dumps({"models": {m: lookup(x) for m, x in models.items()}}))
        monkeypatch.setattr(choice, "ACCURACY_FILE", path)
        choice._measurements.cache_clear()

    yield write
    choice._measurements.cache_clear()


def test_a_budget_takes_the_most_capacity_that_keeps_the_answers(measured):
    measured({"a": {"bf16": 1.0, "int4": 0.99, "turbo4": 0.82, "nvfp4": 0.98, "fp8_e4m3": 0.96, "int8": 1.0}})
    four = choose_codec(4, 3, 64, 16)
    # nvfp4 (4.67 bits) holds more per byte than int4 (5.25 bits) and keeps 0.98x; turbo4 holds the most
    # but keeps 0.82x
    assert (four.codec, four.meets) == ("nvfp4", True)
    assert four.capacity == pytest.approx(16 / (4 + 8 / 16 + 32 / (3 * 64)))  # e4m3 per 16, fp32 per token
    eight = choose_codec(8, 3, 64, 16)
    assert (eight.codec, eight.meets) == ("int8", True)  # fp8 is smaller but loses 4 %
    assert choose_codec(16, 3, 64, 16).codec == "bf16"


def test_a_budget_is_never_served_by_a_narrower_codec(measured):
    measured({"a": {"bf16": 1.0, "int4": 1.0, "fp8_e4m3": 0.5}})
    got = choose_codec(8, 3, 64, 16)  # int4 keeps every answer in fewer bytes, but 8 bits were asked for
    assert (got.codec, got.meets) == ("fp8_e4m3", False)


def test_every_measured_model_must_keep_the_answers(measured):
    measured(
        {"a": {"bf16": 1.0, "int4": 1.0, "turbo4": 0.99}, "b": {"bf16": 1.0, "int4": 0.98, "turbo4": 0.90}}
    )
    got = choose_codec(4, 2, 64, 16)
    assert got.codec == "int4" and got.accuracy == {"a": 1.0, "b": 0.98}


def test_a_model_s_accuracy_pools_the_answers_of_every_answer_scored_measure(tmp_path, monkeypatch):
    """Lookup and multi-hop count by their prompts (the answers kept over all of them, against bf16's);
    free form is scored by likeness to bf16's own text, which any rewording lowers, and does not count."""
    runs = {
        "lookup": (200, {"bf16": 0.8, "int4": 0.8, "turbo4": 0.8, "fp8_e4m3": 0.8}),
        "multihop": (200, {"bf16": 0.3, "int4": 0.3, "turbo4": 0.2, "fp8_e4m3": 0.29}),
        "freeform": (200, {"bf16": 1.0, "int4": 0.6, "turbo4": 0.5, "fp8_e4m3": 0.5}),
    }
    measures = {
        m: {"prompts": n, "reference": "bf16", "source": "test", "accuracy": acc}
        for m, (n, acc) in runs.items()
    }
    path = tmp_path / "codec_accuracy.json"
    path.write_text(json.dumps({"models": {"a": measures}}))
    monkeypatch.setattr(choice, "ACCURACY_FILE", path)
    choice._measurements.cache_clear()
    try:
        four = choose_codec(4, 2, 64, 16)
        assert (four.codec, four.meets) == ("int4", True)  # turbo4 loses 20 of bf16's 220 answers
        assert measured_accuracy("turbo4") == {"a": pytest.approx(200 / 220)}
        # fp8 loses 2 of multi-hop's 60 answers (0.967x there) but keeps 218 of 220 over both measures
        eight = choose_codec(8, 2, 64, 16)
        assert eight.codec == "fp8_e4m3" and eight.accuracy["a"] == pytest.approx(218 / 220) and eight.meets
        assert "a 0.991x" in eight.describe()
    finally:
        choice._measurements.cache_clear()


def test_no_codec_keeping_the_answers_takes_the_best_and_says_its_loss(measured):
    measured({"a": {"bf16": 1.0, "int3": 0.62, "turbo3": 0.39}})
    got = choose_codec(3, 3, 64, 16)
    assert (got.codec, got.meets, got.worst) == ("int3", False, 0.62)
    text = got.describe()
    assert "NO codec within 3 bits" in text and "loses 38%" in text and "larger --kv-cache-bits" in text
    assert got.as_dict()["meets_target"] is False and got.as_dict()["target"] == TARGET


def test_the_cold_tier_takes_any_narrow_width_never_a_full_one(measured):
    measured({"a": {"bf16": 1.0, "fp16": 1.0, "int8": 1.0, "int4": 0.99, "turbo3": 0.5}})
    got = choose_codec(None, 3, 64, 16)
    assert (got.codec, got.budget, got.meets) == ("int4", None, True)
    assert "the cold tier" in got.describe()


def test_a_codec_the_layout_cannot_pack_is_never_chosen(measured):
    measured({"a": {"bf16": 1.0, "turbo4": 1.0, "int4": 0.98}})
    assert choose_codec(4, 2, 64, 16).codec == "turbo4"
    assert choose_codec(4, 2, 48, 16).codec == "int4"  # turbo needs a power-of-two head_dim


def test_unmeasured_codecs_and_budgets(measured):
    measured({"a": {"bf16": 1.0}})
    assert measured_accuracy("int4") == {} and codec_quality("int4", 3, 64, 16, "x") is None
    with pytest.raises(ConfigError, match="no measured KV codec fits 4 bits"):
        choose_codec(4, 3, 64, 16)
    with pytest.raises(ConfigError, match="kv_cache_bits must be one of"):
        choose_codec(5, 3, 64, 16)


def test_the_shipped_measurements_name_real_codecs_and_keep_bf16_at_16_bits():
    data = json.loads(choice.ACCURACY_FILE.read_text())
    for model, measures in data["models"].items():
        run = measures["lookup"]
        assert run["reference"] == "bf16" and run["x_reference"]["bf16"] == 1.0, model
        assert set(run["x_reference"]) <= set(CODEC_NAMES) and run["prompts"] >= 200
    assert choose_codec(16, 3, 64, 16).codec == "bf16"
    for bits in choice.BUDGETS[1:]:
        got = choose_codec(bits, 3, 64, 16)
        assert choice.WIDTH[got.codec] <= bits and got.accuracy


def test_a_named_lossy_codec_says_its_loss(measured):
    measured({"a": {"bf16": 1.0, "turbo3": 0.39}})
    got = codec_quality("turbo3", 3, 64, 16, "--kv-cache-dtype turbo3")
    assert got is not None and not got.meets
    assert got.describe().startswith("--kv-cache-dtype turbo3: turbo3, ")
    assert "it loses 61% of bf16's answers" in got.describe()


def test_codecs_none_run_on_every_measure_are_compared_on_those_they_share(tmp_path, monkeypatch):
    """On model a, kint2-vturbo2 has multi-hop and int2 has not; on model b, the reverse. Neither is
    run on every measure, so both are compared on the one they share, lookup, on each model; pooled
    over its own runs, kint2-vturbo2 (0.85x lookup, 0.2x multi-hop on a) would lose to int2."""

    def run(accuracy: dict[str, float]) -> dict:
        return {"prompts": 200, "reference": "bf16", "source": "t", "accuracy": {"bf16": 1.0, **accuracy}}

    models = {
        "a": {"lookup": run({"int2": 0.8, "kint2-vturbo2": 0.85}), "multihop": run({"kint2-vturbo2": 0.2})},
        "b": {"lookup": run({"int2": 0.8, "kint2-vturbo2": 0.9}), "multihop": run({"int2": 0.1})},
    }
    path = tmp_path / "codec_accuracy.json"
    path.write_text(json.dumps({"models": models}))
    monkeypatch.setattr(choice, "ACCURACY_FILE", path)
    choice._measurements.cache_clear()
    try:
        assert measured_accuracy("kint2-vturbo2")["a"] == pytest.approx((170 + 40) / 400)
        got = choose_codec(2, 3, 64, 16)
        assert got.codec == "kint2-vturbo2" and not got.meets
        assert got.accuracy == {"a": pytest.approx(0.85), "b": pytest.approx(0.9)}
        assert "a 0.850x (lookup)" in got.describe()
        assert got.as_dict()["measures"] == {"a": ["lookup"], "b": ["lookup"]}
        # a user who names it sees every measure it has
        named = codec_quality("kint2-vturbo2", 3, 64, 16, "--kv-cache-dtype kint2-vturbo2")
        assert named is not None and "a 0.525x (lookup + multihop)" in named.describe()
    finally:
        choice._measurements.cache_clear()


def test_a_budget_compares_only_its_codecs_run_on_every_measure(tmp_path, monkeypatch):
    """int2 has lookup only; kint2-vturbo2 and int2dq have lookup and multi-hop. int2 waits for its
    multi-hop run (it is left out, not compared on lookup alone), and the other two are compared on
    both measures: int2dq keeps more answers pooled, though kint2-vturbo2 keeps more on lookup."""
    runs = {
        "lookup": {"bf16": 1.0, "int2": 0.99, "kint2-vturbo2": 0.9, "int2dq": 0.8},
        "multihop": {"bf16": 0.5, "kint2-vturbo2": 0.1, "int2dq": 0.4},
    }
    measures = {
        m: {"prompts": 200, "reference": "bf16", "source": "t", "accuracy": a} for m, a in runs.items()
    }
    path = tmp_path / "codec_accuracy.json"
    path.write_text(json.dumps({"models": {"a": measures}}))
    monkeypatch.setattr(choice, "ACCURACY_FILE", path)
    choice._measurements.cache_clear()
    try:
        assert choice.best_measured(["int2", "kint2-vturbo2", "int2dq"], 16) == ["kint2-vturbo2", "int2dq"]
        got = choose_codec(2, 3, 64, 16)
        assert got.codec == "int2dq" and got.accuracy["a"] == pytest.approx((160 + 80) / 300)
        assert got.as_dict()["measures"] == {"a": ["lookup", "multihop"]}
        # with no codec run on every measure, they are compared on the measures they share
        assert choice.best_measured(["int2"], 16) == ["int2"]
    finally:
        choice._measurements.cache_clear()


def test_the_real_text_family_is_judged_apart_from_the_generated_one(tmp_path, monkeypatch):
    """A codec that keeps generated text's answers but loses real text's is not a budget's pick: each
    family must keep TARGET, as if it were another model (issue 64)."""
    generated = {"bf16": 1.0, "int4": 1.0, "int4dq": 1.0}
    real = {"bf16": 1.0, "int4": 0.99, "int4dq": 0.89}
    entry = lookup(generated)
    entry["lookup.real"] = {**lookup(real)["lookup"]}
    path = tmp_path / "codec_accuracy.json"
    path.write_text(json.dumps({"models": {"a": entry}}))
    monkeypatch.setattr(choice, "ACCURACY_FILE", path)
    choice._measurements.cache_clear()
    try:
        assert measured_accuracy("int4dq") == {"a": 1.0, "a (real text)": pytest.approx(0.89)}
        four = choose_codec(4, 3, 64, 16)
        assert (four.codec, four.meets) == ("int4", True)  # int4dq holds more per byte, loses real text
        assert "a (real text) 0.990x (lookup.real)" in four.describe()
    finally:
        choice._measurements.cache_clear()
