"""Completions and chat over HTTP with the real OpenAI client against a live tiny-random-llama server."""

from __future__ import annotations

import json

from tests.e2e.conftest import TINY, Server

PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def _greedy(server: Server, **kwargs: object):  # type: ignore[no-untyped-def]
    args = {"model": TINY, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kwargs}
    return server.client().completions.create(**args)  # type: ignore[call-overload]


def test_info_routes(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        assert h.get("/health").json() == {"status": "ok"}
        assert "version" in h.get("/version").json()
        ids = h.post("/tokenize", json={"prompt": "hello world"}).json()
        assert ids["count"] == len(ids["tokens"]) > 0
        assert h.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
        chat_ids = h.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat_ids["count"] > ids["count"]
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == [TINY]


def test_completion_shape_usage_and_length(tiny_server: Server) -> None:
    r = _greedy(tiny_server, max_tokens=5)
    assert r.object == "text_completion" and r.model == TINY and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_forms(tiny_server: Server) -> None:
    with tiny_server.http() as h:
        ids = h.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    text = _greedy(tiny_server).choices[0].text
    assert _greedy(tiny_server, prompt=ids).choices[0].text == text
    many = _greedy(tiny_server, prompt=[PROMPT, "Another prompt"])
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == text
    many_ids = _greedy(tiny_server, prompt=[ids, ids[:3]])
    assert many_ids.choices[0].text == text and len(many_ids.choices) == 2


def test_chat_completion(tiny_server: Server) -> None:
    r = tiny_server.client().chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    parts = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
        },
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again."},
    ]
    r2 = tiny_server.client().chat.completions.create(model=TINY, messages=parts, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert r2.usage.completion_tokens == 3


def test_streaming_completion_equals_whole(tiny_server: Server) -> None:
    whole = _greedy(tiny_server, max_tokens=10).choices[0].text
    chunks = list(_greedy(tiny_server, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    with_usage = list(
        _greedy(tiny_server, max_tokens=10, stream=True, stream_options={"include_usage": True})
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 10
    assert sum(1 for c in with_usage if c.choices and c.choices[0].text) > 1  # real per-token deltas


def test_streaming_chat_role_first_then_deltas_usage_done(tiny_server: Server) -> None:
    client = tiny_server.client()
    whole = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=TINY,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        chunks[-1].usage.completion_tokens == 8
        and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    )
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    with tiny_server.http() as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_n_and_seeds(tiny_server: Server) -> None:
    def sample(**kw: object) -> list[str]:
        r = _greedy(tiny_server, temperature=1.0, max_tokens=8, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert sample(seed=123) == sample(seed=123)
    two = sample(seed=123, n=2)
    assert two == sample(seed=123) + sample(seed=124)
    r = tiny_server.client().chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=4, n=2, seed=5)  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8


def test_stop_strings_and_stop_token_ids(tiny_server: Server) -> None:
    text = _greedy(tiny_server, max_tokens=12).choices[0].text
    stop = text[5:9]
    r = _greedy(tiny_server, max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.find(stop)]
    streamed = "".join(c.choices[0].text for c in _greedy(tiny_server, max_tokens=12, stop=stop, stream=True))
    assert streamed == text[: text.find(stop)]
    # logit_bias forces token 500; stop_token_ids ends on it (the token counts, its text does not)
    forced = _greedy(tiny_server, max_tokens=3, logit_bias={"500": 100})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 3
    r = _greedy(tiny_server, max_tokens=3, logit_bias={"500": 100}, extra_body={"stop_token_ids": [500]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1 and r.choices[0].text == ""


def test_logprobs(tiny_server: Server) -> None:
    r = _greedy(tiny_server, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = tiny_server.client().chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)  # greedy = the best token


def test_echo_and_every_sampling_parameter(tiny_server: Server) -> None:
    r = _greedy(tiny_server, echo=True, max_tokens=3)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)
    r = _greedy(
        tiny_server,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"42": -100},
        user="u1",
        seed=1,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "cache_salt": "t1",
        },
    )
    assert r.usage.completion_tokens == 4
