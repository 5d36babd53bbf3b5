"""Structured outputs through the engine on tiny-random-llama: its weights are random, so a valid
document can only come from the grammar. The schemas are bounded (enums, ranges, maxLength,
maxItems), so every sequence completes well inside max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.request import FinishReason, Request, StructuredOutput

from .helpers import corpus_token_ids, generate_with_logits

EOS = 2
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"level": {"enum": [1, 2, 3]}},
                "required": ["level"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "tags", "inner"],
        "additionalProperties": False,
    },
]


def structured(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=50_000_000)


def prompts(llm: LLM, count: int, seed: int = 0) -> list[list[int]]:
    return [corpus_token_ids(llm, 20 + 9 * i, seed=seed + i) for i in range(count)]


def check_valid(out, schema: dict) -> None:
    assert out.finish_reason == FinishReason.STOP, (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_the_grammar_alone_makes_valid_documents_greedy_seeded_and_n(llm):
    ps = prompts(llm, 2)
    params = [
        SamplingParams(max_tokens=80, temperature=0, structured=structured(SCHEMAS[0])),
        SamplingParams(max_tokens=80, temperature=1.0, seed=7, n=3, structured=structured(SCHEMAS[1])),
    ]
    outs = llm.generate(ps, params)
    assert len(outs) == 4
    check_valid(outs[0], SCHEMAS[0])
    for out in outs[1:]:
        check_valid(out, SCHEMAS[1])
        assert EOS not in out.token_ids  # it ended when the object closed, not by sampling eos
    assert len({tuple(o.token_ids) for o in outs[1:]}) > 1  # n samples differ
    # seeded: sample j of n equals a single request with seed + j, token for token
    (again,) = llm.generate(
        [ps[1]], SamplingParams(max_tokens=80, temperature=1.0, seed=8, structured=structured(SCHEMAS[1]))
    )
    assert again.token_ids == outs[2].token_ids


def test_json_object_is_any_object(llm):
    outs = llm.generate(
        prompts(llm, 3, seed=5),
        SamplingParams(max_tokens=300, temperature=0.7, seed=1, structured=StructuredOutput("json_object")),
    )
    for out in outs:
        if out.finish_reason == FinishReason.STOP:  # random weights may fill a string to max_tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")


def test_free_rows_are_bitwise_unchanged_by_constrained_neighbours(llm):
    ps = prompts(llm, 4, seed=10)
    free = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3),
    ]
    alone, alone_logits = generate_with_logits(llm, ps[:2], free)
    constrained = [SamplingParams(max_tokens=80, temperature=0, structured=structured(s)) for s in SCHEMAS]
    mixed, mixed_logits = generate_with_logits(llm, ps, free + constrained)
    for a, m, la, lm in zip(alone, mixed, alone_logits, mixed_logits):
        assert a.token_ids == m.token_ids
        assert torch.equal(la, lm)
    for out, schema in zip(mixed[2:], SCHEMAS):
        check_valid(out, schema)


def test_logprobs_are_the_models_raw_ones(llm):
    params = SamplingParams(max_tokens=80, temperature=0, logprobs=2, structured=structured(SCHEMAS[0]))
    (out,), (logits,) = generate_with_logits(llm, prompts(llm, 1, seed=20), params)
    check_valid(out, SCHEMAS[0])
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(float(raw[step, token]), abs=1e-5)
        assert [t for t, _ in lp.top] == raw[step].topk(2).indices.tolist()  # unmasked alternatives


def test_warm_equals_cold_token_for_token(llm):
    prompt = corpus_token_ids(llm, 100, seed=30)  # 3 whole chunks of 32 tokens
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=5, structured=structured(SCHEMAS[1]))
    (cold,) = llm.generate([prompt], params)
    (warm,) = llm.generate([prompt], params)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 96
    assert warm.token_ids == cold.token_ids
    check_valid(warm, SCHEMAS[1])


def test_preemption_neither_replays_nor_loses_grammar_state():
    roomy = LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=50_000_000)
    tight = LLM(model="tiny-random-llama", chunk_size=32, max_cache_bytes=20 * 16 * 1024)  # 320 tokens
    ps = [corpus_token_ids(roomy, 60 + 7 * i, seed=40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=80, temperature=0, structured=structured(SCHEMAS[1]))
    expected = roomy.generate(ps, params)
    tight.engine.check_integrity_each_step = True
    got = tight.generate(ps, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out in got:
        check_valid(out, SCHEMAS[1])


def test_unconstrained_steps_do_no_mask_work(llm, monkeypatch):
    def fail(*args):
        raise AssertionError("mask work in a step without constrained rows")

    monkeypatch.setattr(llm.engine.grammars, "allowed_tokens", fail)
    (out,) = llm.generate(prompts(llm, 1, seed=50), SamplingParams(max_tokens=5, temperature=0))
    assert len(out.token_ids) == 5


def test_a_failing_mask_fails_only_the_constrained_requests(llm, monkeypatch):
    def fail(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine.grammars, "allowed_tokens", fail)
    ps = prompts(llm, 2, seed=60)
    free, constrained = llm.generate(
        ps,
        [
            SamplingParams(max_tokens=5, temperature=0),
            SamplingParams(max_tokens=5, temperature=0, structured=structured(SCHEMAS[0])),
        ],
    )
    assert len(free.token_ids) == 5 and free.finish_reason == FinishReason.LENGTH
    assert constrained.finish_reason == FinishReason.ERROR and "grammar mask" in (constrained.error or "")


def test_invalid_schema_and_ignore_eos_are_refused_before_queueing(llm):
    engine = llm.engine
    prompt = prompts(llm, 1)[0]
    bad = SamplingParams(structured=StructuredOutput("json_schema", '{"type":"wat"}'))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(Request("bad-schema", prompt, bad))
    assert err.value.param == "response_format" and "wat" in str(err.value)
    eos = SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))
    with pytest.raises(InvalidRequestError) as err:
        engine.check_request(Request("ignore-eos", prompt, eos))
    assert err.value.param == "ignore_eos"
    assert not engine.has_unfinished_requests()
