"""The weight-precision policy (kvserve/engine/precision.py): fixed settings, and auto's switch to fp8
under queue or TTFT pressure and back to fp16 only past the hysteresis."""

from __future__ import annotations

from kvserve.config import ServeConfig
from kvserve.engine.precision import WINDOW_S, PrecisionPolicy


def policy(**kw) -> PrecisionPolicy:
    return PrecisionPolicy(ServeConfig(model="tiny-random-llama", **kw).model_config)


def test_fixed_settings():
    assert policy().assign(100, 0.0) is None  # dense weights: no precision
    for mode in ("fp16", "fp8"):
        p = policy(weight_precision=mode)
        assert [p.assign(n, float(n)) for n in (0, 50, 0)] == [mode] * 3
        assert p.num_switches == 0 and p.requests[mode] == 3


def test_auto_follows_the_queue_with_hysteresis():
    p = policy(weight_precision="auto", fp8_queue_depth=4, precision_hold_s=2.0)
    assert p.assign(3, 0.0) == "fp16"
    assert p.assign(4, 0.1) == "fp8"  # at the threshold
    assert p.assign(3, 5.0) == "fp8"  # under it, but above half of it
    assert p.assign(2, 1.0) == "fp8"  # calm, but fp8 has not held 2 s yet
    assert p.assign(2, 2.1) == "fp16"
    assert p.num_switches == 2 and p.requests == {"fp16": 2, "fp8": 3}


def test_auto_follows_the_ttft_objective():
    p = policy(weight_precision="auto", slo_ttft_ms=500, fp8_queue_depth=100, precision_hold_s=0)
    for i in range(9):
        p.observe_ttft(0.2, float(i) / 10)
    p.observe_ttft(0.9, 1.0)
    assert p.ttft_p90(1.0) == 0.2 and p.assign(0, 1.0) == "fp16"  # one slow first token in ten
    p.observe_ttft(0.9, 1.1)
    assert p.ttft_p90(1.1) == 0.9 and p.assign(0, 1.1) == "fp8"  # two of eleven: the p90 is over
    for i in range(32):
        p.observe_ttft(0.4, 2.0 + i / 100)
    assert p.assign(0, 3.0) == "fp8"  # 0.4 s is under 0.5 s but not under 0.7 x 0.5 s
    for i in range(32):
        p.observe_ttft(0.3, 4.0 + i / 100)
    assert p.assign(0, 5.0) == "fp16"
    p.observe_ttft(5.0, 6.0)
    assert p.assign(0, 6.0 + WINDOW_S + 1) == "fp16"  # no recent first tokens: calm
