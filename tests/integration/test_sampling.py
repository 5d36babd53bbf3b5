"""Sampling parameters are honoured."""

from __future__ import annotations

import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import FinishReason


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", max_cache_bytes=300_000_000)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.to_token_ids([{"role": "user", "content": text}])


def test_greedy_answers_and_stops_at_eos(llm: LLM):
    (out,) = llm.generate(
        [chat(llm, "What is the capital of France?")], SamplingParams(max_tokens=30, temperature=0)
    )
    assert "Paris" in out.text and out.finish_reason == FinishReason.STOP


def test_seed_reproducible_and_different_seeds_differ(llm: LLM):
    p = chat(llm, "Write a short poem about the sea.")
    a, b, c = llm.generate(
        [p, p, p], [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in (1, 1, 2)]
    )
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_stop_strings_and_stop_token_ids(llm: LLM):
    p = chat(llm, "Count from 1 to 20 separated by commas.")
    (full,) = llm.generate([p], SamplingParams(max_tokens=40, temperature=0))
    assert "5" in full.text
    (cut,) = llm.generate([p], SamplingParams(max_tokens=40, temperature=0, stop=["5"]))
    assert cut.finish_reason == FinishReason.STOP and cut.stop_reason == "5"
    assert cut.text == full.text[: full.text.index("5")]
    (kept,) = llm.generate(
        [p], SamplingParams(max_tokens=40, temperature=0, stop=["5"], include_stop_str_in_output=True)
    )
    assert kept.text.endswith("5")
    stop_id = full.token_ids[3]
    (tok,) = llm.generate([p], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_id]))
    first = full.token_ids.index(stop_id)
    assert tok.token_ids == full.token_ids[: first + 1] and tok.stop_reason == stop_id


def test_max_tokens_and_ignore_eos(llm: LLM):
    p = chat(llm, "Say hi.")
    (out,) = llm.generate([p], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 40 and out.finish_reason == FinishReason.LENGTH


def test_logprobs_are_log_softmax_of_the_model(llm: LLM):
    p = chat(llm, "Name a color.")
    (out,) = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == tok and math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)  # greedy = top-1


def test_top_k_1_equals_greedy_and_logit_bias_forces_a_token(llm: LLM):
    p = chat(llm, "What is 2 + 2?")
    (greedy,) = llm.generate([p], SamplingParams(max_tokens=8, temperature=0))
    (topk,) = llm.generate([p], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3))
    assert topk.token_ids == greedy.token_ids
    forced = llm.tokenizer.encode(" banana")[0]
    (biased,) = llm.generate([p], SamplingParams(max_tokens=3, temperature=0, logit_bias={forced: 100.0}))
    assert biased.token_ids == [forced] * 3


def test_repetition_penalties_change_repetitive_output(llm: LLM):
    p = chat(llm, "Repeat the word 'cat' ten times.")
    (plain,) = llm.generate([p], SamplingParams(max_tokens=20, temperature=0))
    (penalized,) = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, frequency_penalty=2.0))
    assert plain.token_ids != penalized.token_ids
    assert max(penalized.token_ids.count(t) for t in set(penalized.token_ids)) <= max(
        plain.token_ids.count(t) for t in set(plain.token_ids)
    )


def test_streaming_deltas_concatenate_to_the_text(llm: LLM):
    from kvserve.request import Request

    engine = llm.engine
    engine.add_request(
        Request(
            "s1",
            chat(llm, "Tell me about café culture in Paris."),
            SamplingParams(max_tokens=30, temperature=0, stop=["Paris is"]),
        )
    )
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            deltas.append(out.new_text)
            if out.finished:
                final = out
    assert "".join(deltas) == final.text
    assert "\ufffd" not in final.text


def test_outputs_are_deltas_whose_size_does_not_grow_with_the_output(llm: LLM):
    """Every output but the last carries only what is new (tokens, text from its offset, logprobs,
    the prompt's logprobs once); the final one carries the whole generation. So the 200th token's
    output is no bigger than the 20th's (pickled: what a cluster replica sends per token)."""
    import pickle

    from kvserve.request import Request

    prompt = chat(llm, "Write a long story about a lighthouse keeper.")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    llm.engine.add_request(Request("d1", prompt, params))
    outs = []
    while not outs or not outs[-1].finished:
        outs.extend(llm.engine.step())
    *deltas, final = outs
    assert all(not d.token_ids and not d.text and d.logprobs is None for d in deltas)
    assert all(len(o.new_logprobs or []) == len(o.new_token_ids) for o in outs)
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert [e for o in outs for e in o.new_logprobs or []] == final.logprobs
    assert "".join(o.new_text for o in outs) == final.text
    assert all(final.text[o.text_offset :].startswith(o.new_text) for o in outs)
    assert [o for o in deltas if o.prompt_logprobs is not None] == deltas[:1]
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == len(prompt)
    sizes = [len(pickle.dumps(o)) for o in deltas if len(o.new_token_ids) == 1]
    assert len(final.token_ids) == 200 and len(sizes) > 150
    assert max(sizes[-20:]) <= 1.1 * max(sizes[10:30])


def test_a_final_only_request_gets_one_output_equal_to_the_streamed_final(llm: LLM):
    """final_only (what LLM.generate asks for) skips the per-step deltas; its one output is the final
    one a streamed request ends with, and carries the whole generation in its new_* fields too."""
    from kvserve.request import Request

    prompt = chat(llm, "Write a short story about a lighthouse keeper.")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    llm.engine.add_request(Request("f-stream", prompt, params))
    llm.engine.add_request(Request("f-final", prompt, params, final_only=True))
    outs: dict[str, list] = {"f-stream": [], "f-final": []}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            outs[out.request_id].append(out)
    (final,) = outs["f-final"]
    streamed = outs["f-stream"][-1]
    assert len(outs["f-stream"]) > 1 and final.finished and streamed.finished
    for field in ("token_ids", "text", "logprobs", "prompt_logprobs", "finish_reason"):
        assert getattr(final, field) == getattr(streamed, field), field
    assert final.new_token_ids == final.token_ids and final.new_text == final.text
    assert final.new_logprobs == final.logprobs and final.text_offset == 0


def test_the_batch_sampler_gives_the_tokens_each_row_gets_alone(monkeypatch: pytest.MonkeyPatch):
    """A mixed batch (greedy, seeded temperature / top-k / top-p / min-p, penalties, bias, logprobs)
    sampled by the step's batch sampler equals the same batch sampled row by row with sample_one (the
    step's fallback), token for token and logprob for logprob; the batched run calls sample_one never."""
    import kvserve.engine.update as update

    tiny = LLM(model="tiny-random-llama", max_cache_bytes=50_000_000)
    prompts = [[10 + 7 * i + j for j in range(12 + i)] for i in range(8)]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.2, top_k=20, top_p=0.9, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, min_p=0.05, seed=3, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=1.0,
            presence_penalty=0.5,
            frequency_penalty=0.7,
            seed=4,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=12, temperature=0.9, logit_bias={5: 4.0, 17: -2.0}, seed=5, ignore_eos=True
        ),
    ]

    def never(*args, **kwargs):
        raise AssertionError("sample_one called in a batched step")

    with monkeypatch.context() as m:
        m.setattr(update, "sample_one", never)
        batched = tiny.generate(prompts, params)

    def batch_fails(*args, **kwargs):
        raise RuntimeError("no batch sampler")

    monkeypatch.setattr(update, "sample_batch", batch_fails)
    alone = tiny.generate(prompts, params)
    for b, a in zip(batched, alone):
        assert b.finish_reason == a.finish_reason == FinishReason.LENGTH, b.error
        assert b.token_ids == a.token_ids
        assert repr(b.logprobs) == repr(a.logprobs)  # repr: the floats exactly
