"""The verified-presets file `auto` reads, its targets, and the online watch (reuse/verified.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.errors import ConfigError
from kvserve.request import ReuseOptions
from kvserve.reuse import verified
from kvserve.reuse.verified import AutoWatch, Targets, VerifiedPreset, shortfalls, targets_for

ROOT = Path(__file__).resolve().parents[2]


def preset(agreement: float = 0.9) -> VerifiedPreset:
    return VerifiedPreset(
        "m", "query R=4 0.45", ReuseOptions(recompute_strategy="query"), "content", agreement, "x"
    )


def figures(x: float, ttft: float) -> dict:
    return {
        f: {m: {"x_full": x, "ttft_x_full": ttft} for m in ("lookup", "multihop", "recall")}
        for f in ("generated", "real")
    }


def test_the_package_file_lists_only_entries_that_parse_and_name_their_data():
    for model, entry in verified.load().items():
        p = verified.parse_entry(model, entry)
        assert 0.0 <= p.audit_agreement <= 1.0
        for data in entry["data"]:
            assert (ROOT / data).is_file(), f"{model}: its data file {data} is not in the repo"
        if entry["verified"]:
            assert not shortfalls(targets_for(model), entry["figures"]), model
        else:
            assert entry["limits"], f"{model} missed: the file says what limits it"


def test_targets_need_every_family_and_measure_and_the_ttft():
    t = Targets({"lookup": 0.97, "multihop": 0.97, "recall": 0.95}, 0.5)
    assert shortfalls(t, figures(0.98, 0.45)) == []
    assert shortfalls(t, figures(0.96, 0.45)) == [
        f"{f} {m}: 0.960x full prefill's answers < {t.accuracy[m]}x"
        for f in ("generated", "real")
        for m in ("lookup", "multihop")
    ]
    slow = shortfalls(t, figures(0.98, 0.6))
    assert len(slow) == 6 and all("TTFT p50 0.60x" in s for s in slow)
    unanswered = figures(0.98, 0.45)
    unanswered["real"]["lookup"]["x_full"] = float("nan")  # full prefill answered none: no evidence
    assert shortfalls(t, unanswered) == ["real lookup: nanx full prefill's answers < 0.97x"]
    one_family = figures(0.98, 0.45)
    del one_family["real"]
    assert shortfalls(t, one_family) == [f"real {m}: not measured" for m in ("lookup", "multihop", "recall")]
    assert targets_for("qwen2.5-coder-1.5b").ttft == 0.4 and targets_for("smollm2-135m").ttft == 0.5


def test_a_malformed_or_missing_file_is_a_config_error_that_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="--verify MODEL"):
        verified.load(str(tmp_path / "absent.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        verified.load(str(bad))
    bad.write_text(json.dumps({"models": {"m": {"verified": True, "preset": {"name": "q", "ratio": 1}}}}))
    with pytest.raises(ConfigError, match="unknown fields"):
        verified.verified_preset("m", str(bad))
    bad.write_text(json.dumps({"models": {"m": {"verified": True, "preset": {"name": "q"}}}}))
    with pytest.raises(ConfigError, match="malformed"):
        verified.verified_preset("m", str(bad))
    assert verified.verified_preset("other", str(bad)) is None


def test_the_watch_falls_back_once_when_audits_are_clearly_below_and_not_on_noise(caplog):
    steady = AutoWatch(preset(0.9))
    for i in range(500):
        assert not steady.observe(0.9 + (0.1 if i % 2 else -0.1))  # mean 0.9: never clearly below
    assert steady.active() is not None and steady.stats()["num_audits"] == verified.WATCH_WINDOW

    low = AutoWatch(preset(0.9))
    fired = [low.observe(0.6 + (0.1 if i % 2 else -0.1)) for i in range(verified.WATCH_MIN_AUDITS + 5)]
    assert fired.index(True) == verified.WATCH_MIN_AUDITS - 1 and fired.count(True) == 1
    assert low.active() is None and "below the verification's 0.900" in low.stats()["fell_back"]
    assert "falls back to exact serving" in caplog.text

    few = AutoWatch(preset(0.9))
    assert not any(few.observe(0.0) for _ in range(verified.WATCH_MIN_AUDITS - 1))  # too few to judge
    assert AutoWatch(None).observe(0.0) is False and AutoWatch(None).stats()["preset"] is None
