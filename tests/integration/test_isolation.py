"""One request can never hurt another: a fault while processing one sequence (sampling,
detokenizing, a repair forward, a kernel) fails that request alone; the others finish with the
output they have without the fault."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import FinishReason, Request, RequestOutput, ReuseOptions
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture()
def llm() -> LLM:
    return LLM(
        model="tiny-random-llama",
        chunk_size=CHUNK,
        max_cache_bytes=50_000_000,
        pieces="fixed",
        reuse_min_saving=-10.0,
    )


def _prompts(llm: LLM) -> list[list[int]]:
    return [corpus_token_ids(llm, n, seed=300 + n) for n in (41, 57, 70, 83)]


def _run(llm: LLM, requests: list[Request], unchecked: Request | None = None) -> dict[str, RequestOutput]:
    """Runs `requests` to the end; `unchecked` among them is added past intake's checks."""
    engine = llm.engine
    engine.check_integrity_each_step = True
    for r in requests:
        if r is unchecked:
            _add_unchecked(llm, r)
        else:
            engine.add_request(r)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_integrity()
    return done


def _reference(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _check(done: dict[str, RequestOutput], bad: str, expected: dict[str, list[int]]) -> None:
    assert done[bad].finish_reason == FinishReason.ERROR and done[bad].error, done[bad]
    for rid, tokens in expected.items():
        assert done[rid].finish_reason == FinishReason.LENGTH, (rid, done[rid].error)
        assert done[rid].token_ids == tokens, rid


def test_a_sampling_fault_fails_only_its_request(llm: LLM):
    prompts = _prompts(llm)
    expected = dict(zip("abcd", _reference(llm, prompts)))
    requests = [Request(rid, p, GREEDY) for rid, p in zip("abcd", prompts)]
    # a logit_bias id past the vocabulary that got past intake: the sampler raises for this sequence
    bad_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    object.__setattr__(bad_params, "logit_bias", {llm.tokenizer.vocab_size + 5: 1.0})
    bad = Request("bad", prompts[0][:20], bad_params)
    done = _run(llm, [*requests[:2], bad, *requests[2:]], unchecked=bad)
    _check(done, "bad", expected)


def _add_unchecked(llm: LLM, request: Request) -> None:
    """Adds with valid parameters, then swaps in the bad ones (as if intake had missed them)."""
    bad = request.sampling_params
    request.sampling_params = SamplingParams(max_tokens=bad.max_tokens, temperature=0, ignore_eos=True)
    llm.engine.add_request(request)
    request.sampling_params = bad


def test_a_detokenizer_fault_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    prompts = _prompts(llm)
    expected = dict(zip("abcd", _reference(llm, prompts)))
    from kvserve.tokenizer import IncrementalDetokenizer

    poison = 4242
    add = IncrementalDetokenizer.add

    def exploding_add(self, token_id):  # type: ignore[no-untyped-def]
        if token_id == poison:
            raise RuntimeError("detokenizer exploded")
        return add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", exploding_add)
    forced = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={poison: 100.0})
    requests = [Request(rid, p, GREEDY) for rid, p in zip("abcd", prompts)]
    done = _run(llm, [*requests[:2], Request("bad", prompts[1][:30], forced), *requests[2:]])
    _check(done, "bad", expected)


def test_a_kernel_fault_fails_only_the_sequence_that_caused_it(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    prompts = _prompts(llm)
    expected = dict(zip("abcd", _reference(llm, prompts)))
    backend = llm.engine.runner.backend
    forward = backend.forward
    poison_len = 37  # only the bad prompt has 37 tokens: its prefill rows trip the "kernel"

    def faulty(query, kv, meta, scale):  # type: ignore[no-untyped-def]
        if poison_len in meta.query_lens_list:
            raise RuntimeError("kernel fault")
        return forward(query, kv, meta, scale)

    monkeypatch.setattr(backend, "forward", faulty)
    requests = [Request(rid, p, GREEDY) for rid, p in zip("abcd", prompts)]
    bad = Request("bad", corpus_token_ids(llm, poison_len, seed=9), GREEDY)
    done = _run(llm, [requests[0], bad, *requests[1:]])
    _check(done, "bad", expected)


def test_a_repair_forward_fault_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    doc = corpus_token_ids(llm, 3 * CHUNK, seed=310)
    llm.warm(doc)
    prompts = _prompts(llm)
    expected = dict(zip("abcd", _reference(llm, prompts)))
    repairer = llm.engine.reuse.repairer
    assert repairer is not None

    def explode(seq):  # type: ignore[no-untyped-def]
        raise RuntimeError("moving KV fault")

    monkeypatch.setattr(repairer, "begin", explode)
    rag = corpus_token_ids(llm, CHUNK, seed=311) + doc + [5, 6, 7]
    opts = ReuseOptions(reuse="any", recompute_strategy="selective")
    requests = [Request(rid, p, GREEDY) for rid, p in zip("abcd", prompts)]
    done = _run(llm, [requests[0], requests[1], Request("bad", rag, GREEDY, reuse=opts), *requests[2:]])
    _check(done, "bad", expected)
