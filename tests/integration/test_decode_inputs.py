"""A plain decode step's inputs come from ModelRunner._decode_inputs (lists of tokens, positions and
tables, no per-sequence tensors): they must be prepare_inputs' general path's, field by field, and the
general path must still serve every step that is not a plain decode."""

from __future__ import annotations

import dataclasses

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner, StepInputs


def assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    for f in dataclasses.fields(StepInputs):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "meta":
            for g in dataclasses.fields(a):
                x, y = getattr(a, g.name), getattr(b, g.name)
                if isinstance(x, torch.Tensor):
                    assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), g.name
                else:
                    assert x == y, g.name
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_plain_decode_inputs_equal_the_general_paths(monkeypatch):
    llm = LLM(model="tiny-random-llama", dtype="bfloat16", max_cache_bytes=20_000_000)
    general = ModelRunner.prepare_inputs
    taken = {"decode": 0, "general": 0}

    def checked(self, batch):
        got = general(self, batch)
        if self._plain_decode(batch.items):
            taken["decode"] += 1
            monkeypatch.setattr(ModelRunner, "_plain_decode", lambda self, items: False)
            try:
                assert_same_inputs(got, general(self, batch))
            finally:
                monkeypatch.undo()
                monkeypatch.setattr(ModelRunner, "prepare_inputs", checked)
        else:
            taken["general"] += 1
        return got

    monkeypatch.setattr(ModelRunner, "prepare_inputs", checked)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4," * 20, "Once upon a time"]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)  # past a block edge
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert taken["decode"] > 30 and taken["general"] > 0  # the prompts' prefills take the general path


def test_steps_that_are_not_plain_decode_take_the_general_path():
    llm = LLM(model="tiny-random-llama", dtype="bfloat16", max_cache_bytes=20_000_000)
    seen: list[bool] = []
    runner = llm.engine.runner
    plain = runner._plain_decode
    runner._plain_decode = lambda items: seen.append(plain(items)) or seen[-1]  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1)
    llm.generate(["a prompt whose logprobs are asked for"], params)
    assert seen and not seen[0]  # the prefill scores prompt tokens
    seen.clear()
    llm.generate(["another prompt"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen == [False, True, True]  # its prefill, then two decode steps
