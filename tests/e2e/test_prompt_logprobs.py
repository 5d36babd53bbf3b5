"""/v1/completions with echo and logprobs (prompt logprobs) against live servers, through the real
OpenAI SDK and in the exact shape lm-evaluation-harness's `local-completions` reads; the values
equal a plain Hugging Face fp32 forward's within 1e-4, cold or cached."""

from __future__ import annotations

import json
import random
from typing import Any

import openai
import pytest
import torch
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM

from kvserve.models.loader import resolve_model_path
from tests.e2e.conftest import SMOLLM2, TINY, Server

TOL = 1e-4


def _hf(model: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tiny() -> torch.nn.Module:
    return _hf(TINY)


@torch.inference_mode()
def hf_logprobs(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row j - 1 scores token j; the last row scores the next token."""
    return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 10_000) for _ in range(n)]


def completion(server: Server, **body: Any) -> dict[str, Any]:
    """The raw JSON body (what lm-eval reads)."""
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": body.pop("model", TINY), "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_part(lp: dict[str, Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    """The first len(ids) entries: null first, then each token's logprob (HF's within TOL) and a
    top_logprobs dict of the token itself and the top k (vLLM's shape)."""
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0
    offsets = lp["text_offset"][:n]
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"], strict=False))
    got = torch.tensor(lp["token_logprobs"][1:n], dtype=torch.float64)
    want = ref[torch.arange(n - 1), torch.tensor(ids[1:])].double()
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    best = ref[: n - 1].topk(max(k, 1), dim=-1).values
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]  # the token itself is always there
        assert k <= len(top) <= k + 1
        if k:
            assert max(top.values()) == pytest.approx(float(best[i - 1, 0]), abs=TOL)


def test_echo_max_tokens_0_equals_hf_cold_and_cached(tiny_server: Server, hf_tiny: torch.nn.Module) -> None:
    ids = random_ids(300, seed=1)
    ref = hf_logprobs(hf_tiny, ids)
    client = tiny_server.client()
    r = client.completions.create(model=TINY, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (300, 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 300
    check_prompt_part(lp.model_dump(), ids, ref, 2)
    # a plain request caches the prompt's chunks; scoring it again recomputes it, to the same values
    plain = client.completions.create(model=TINY, prompt=ids, max_tokens=1)
    again = client.completions.create(model=TINY, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    assert plain.usage is not None and again.usage is not None
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.choices[0].logprobs == lp


def test_lm_eval_local_completions_reads_the_loglikelihoods(
    tiny_server: Server, hf_tiny: torch.nn.Module
) -> None:
    """What lm-eval 0.4.13 sends for loglikelihood (token-id prompts, max_tokens 1, logprobs 1, echo)
    and its own parse_logprobs on the answer: sum of the continuation's logprobs and is_greedy."""
    context = random_ids(40, seed=2)
    greedy_next = int(hf_logprobs(hf_tiny, context)[-1].argmax())
    continuations = [[greedy_next], [greedy_next + 1, 7, 8]]  # greedy; then not greedy
    prompts = [context + c for c in continuations]
    body = completion(tiny_server, prompt=prompts, max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1  # the prompt, then 1 generated
    ctxlens = [len(context)] * 2
    parsed = LocalCompletionsAPI.parse_logprobs(body, tokens=prompts, ctxlens=ctxlens)
    for (loglik, _), prompt, cont in zip(parsed, prompts, continuations, strict=True):
        ref = hf_logprobs(hf_tiny, prompt)
        want = sum(float(ref[len(context) - 1 + i, t]) for i, t in enumerate(cont))
        assert loglik == pytest.approx(want, abs=1e-3)
    assert [g for _, g in parsed] == [True, False]


def test_streaming_n_and_several_prompts_match_the_whole_response(tiny_server: Server) -> None:
    prompts = [random_ids(20, seed=3), random_ids(9, seed=4)]
    args: dict[str, Any] = dict(prompt=prompts, echo=True, logprobs=1, max_tokens=3, n=2, seed=5)
    whole = completion(tiny_server, **args, temperature=0.8)
    with (
        tiny_server.http() as h,
        h.stream(
            "POST", "/v1/completions", json={"model": TINY, **args, "temperature": 0.8, "stream": True}
        ) as r,
    ):
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    streamed: dict[int, dict[str, list[Any]]] = {}
    text: dict[int, str] = {}
    for chunk in map(json.loads, chunks[:-1]):
        (c,) = chunk["choices"]
        first = c["index"] not in streamed
        lp = streamed.setdefault(
            c["index"], {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        )
        text[c["index"]] = text.get(c["index"], "") + c["text"]
        if c["logprobs"] is not None:
            if first:  # the prompt part arrives whole in a choice's first chunk
                assert len(c["logprobs"]["tokens"]) >= len(prompts[c["index"] // 2])
            for key in lp:
                lp[key] += c["logprobs"][key]
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        i = choice["index"]
        assert len(choice["logprobs"]["tokens"]) == len(prompts[i // 2]) + 3
        assert streamed[i] == choice["logprobs"] and text[i] == choice["text"]


def test_max_tokens_0_streams_the_prompt_alone_and_needs_echo(tiny_server: Server) -> None:
    ids = random_ids(12, seed=6)
    whole = completion(tiny_server, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    (choice,) = whole["choices"]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the token
    stream = tiny_server.client().completions.create(
        model=TINY, prompt=ids, echo=True, logprobs=0, max_tokens=0, stream=True
    )
    (only,) = list(stream)
    assert only.choices[0].finish_reason == "length" and only.choices[0].text == choice["text"]
    assert only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.model_dump() == choice["logprobs"]
    with pytest.raises(openai.BadRequestError) as info:
        tiny_server.client().completions.create(model=TINY, prompt=ids, max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "echo" in info.value.body["message"]  # type: ignore[index]


def test_smollm2_text_prompt_equals_hf(smollm2_server: Server) -> None:
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    with smollm2_server.http() as h:
        ids = h.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    client = smollm2_server.client()
    r = client.completions.create(
        model=SMOLLM2, prompt=prompt, echo=True, logprobs=3, max_tokens=1, temperature=0
    )
    (choice,) = r.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(prompt)
    assert lp.text_offset is not None and lp.text_offset[len(ids)] == len(prompt)
    ref = hf_logprobs(_hf(SMOLLM2), ids)
    check_prompt_part(lp.model_dump(), ids, ref, 3)
    assert lp.tokens[-1] == choice.text[len(prompt) :]  # greedy: HF's best next token
    assert lp.token_logprobs is not None
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=TOL)
