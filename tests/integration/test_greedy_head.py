"""A greedy step's LM head takes the argmax in its kernel (engine/model_runner.py SampledRows.greedy_tokens,
row_linear_bf16_argmax on AMX tiles): the tokens are those of the logits path, bitwise, and the path is taken
only where nothing needs the logits."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner, SampledRows
from kvserve.kernels.cpu_features import has_amx_bf16

pytestmark = pytest.mark.skipif(not has_amx_bf16(), reason="the fused head argmax runs on AMX tiles")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_greedy_tokens_from_the_fused_head_are_the_logits_paths(monkeypatch):
    llm = LLM(model="tiny-random-llama", dtype="bfloat16", max_cache_bytes=20_000_000)
    runner = llm.engine.runner
    assert runner.head_argmax is not None  # a bf16 head on AMX tiles
    calls = {"fused": 0}
    fused = type(runner).head_argmax.fget

    def counting(self):
        f = fused(self)
        if f is None:
            return None

        def run(hidden):
            calls["fused"] += 1
            return f(hidden)

        return run

    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    monkeypatch.setattr(ModelRunner, "head_argmax", property(counting))
    got = generate(llm, greedy)
    assert calls["fused"] > 0
    monkeypatch.setattr(ModelRunner, "head_argmax", property(lambda self: None))
    want = generate(llm, greedy)  # the same engine, its cache warm: the tokens depend on neither
    assert got == want


def test_rows_that_need_logits_take_the_logits_path(monkeypatch):
    llm = LLM(model="tiny-random-llama", dtype="bfloat16", max_cache_bytes=20_000_000)

    def refuse(self):
        raise AssertionError("the fused head ran for rows that need their logits")

    monkeypatch.setattr(ModelRunner, "head_argmax", property(refuse))
    for params in (
        SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ):
        assert all(len(t) == 4 for t in generate(llm, params))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_each_step_observes_its_cost_with_the_head_inside(monkeypatch, temperature):
    """The head runs when the update asks for tokens or logits, after the forward: the step's cost
    (reuse/cost.py) is observed then, once a step, and includes the head's time."""
    llm = LLM(model="tiny-random-llama", dtype="bfloat16", max_cache_bytes=20_000_000)
    observed: list[float] = []
    monkeypatch.setattr(llm.engine.cost, "observe", lambda work, seconds: observed.append(seconds))
    head_times: list[float] = []
    original = SampledRows._head

    def timed(self, run):
        start = time.perf_counter()
        out = original(self, run)
        head_times.append(time.perf_counter() - start)
        return out

    monkeypatch.setattr(SampledRows, "_head", timed)
    steps_before = llm.engine.num_steps
    generate(llm, SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True))
    assert len(observed) == llm.engine.num_steps - steps_before == len(head_times)
    assert all(seconds >= head for seconds, head in zip(observed, head_times, strict=True))
