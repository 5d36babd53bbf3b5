"""The real default model: greedy output over HTTP equals the Python API's (kvserve.LLM), and the
start-up summary and --warm progress are printed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import Server, launch, stop

MODEL = "smollm2-135m"
CACHE_BYTES = "200000000"
PROMPT = "The three primary colors are"
WARM_TEXT = "You are a helpful assistant who answers in one sentence. " * 20  # > one 128-token chunk


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = launch(
        tmp_path_factory.mktemp("kvserve"),
        "--model",
        MODEL,
        "--max-cache-bytes",
        CACHE_BYTES,
        "--warm",
        WARM_TEXT,
    )
    yield s
    stop(s)


def test_greedy_http_equals_python_api(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a primary color."}],
        max_tokens=16,
        temperature=0,
    )
    llm = LLM(MODEL, max_cache_bytes=int(CACHE_BYTES))
    params = SamplingParams(max_tokens=24, temperature=0)
    (expected,) = llm.generate(PROMPT, params)
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.token_ids)
    (expected_chat,) = llm.generate(
        [[{"role": "user", "content": "Name a primary color."}]], SamplingParams(max_tokens=16, temperature=0)
    )
    assert chat.choices[0].message.content == expected_chat.text


def test_startup_summary_and_warm(server: Server) -> None:
    log = server.log()
    for word in (
        "kvserve: model smollm2-135m",
        "device cpu",
        "dtype float32",
        "KV codec",
        "KV pool",
        "tokens",
        "MiB",
        "attention backend",
        "warm-up",
    ):
        assert word in log, word
    assert WARM_TEXT not in log  # prompts are not logged
    assert server.stats()["cache"]["pinned_chunks"] >= 1
