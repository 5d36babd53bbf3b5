"""No request waits on background work (issue 32): with the online audit on, a prompt served from a
content hit queues an audit, which runs in idle steps and used to hold the prompt's chunks in flight;
the same prompt sent again at once waited on those chunks while the audit waited for an idle step,
and hung (streamed: 200 headers, then no bytes). The real default model, so that the audit is still
computing when the repeat arrives."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SMOLLM2_FLAGS, TINY, TINY_FLAGS, Server, launch, stop

WORDS = (
    "river stone garden window market letter silver morning harbor candle orchard bridge village "
    "lantern meadow forest winter summer engine copper cotton marble ribbon tunnel valley island"
).split()


def document(seed: int, num_words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."


@pytest.fixture(scope="module")
def audited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = launch(
        tmp_path_factory.mktemp("kvserve-audit"),
        *SMOLLM2_FLAGS,
        *("--reuse", "any", "--recompute-strategy", "selective", "--audit-rate", "1"),
    )
    yield server
    stop(server)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_repeat_of_an_audited_prompt_is_served_at_once(audited_server: Server, stream: bool) -> None:
    client = audited_server.client().with_options(timeout=60)
    base = 10 if stream else 20
    first, second = document(base), document(base + 1)
    question = "\nQuestion: which word comes up most often?\nAnswer:"
    a = first + "\n\n" + second + question
    b = second + "\n\n" + first + question

    def complete(prompt: str) -> tuple[str, int]:
        if not stream:
            out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0)
            return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens
        chunks = client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, cached = "", 0
        for chunk in chunks:
            text += "".join(c.text for c in chunk.choices)
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return text, cached

    complete(a)
    _, cached = complete(b)
    assert cached > 0, "b is served from a content hit (its audit is queued)"
    text, _ = complete(b)  # at once: before the fix this hung until the client's 60 s timeout
    assert text
    queue = audited_server.stats()["queue"]
    assert queue["timed_out"] == 0 and queue["errored"] == 0


@pytest.fixture(scope="module")
def budgeted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Approximate reuse taken whenever it matches, no sampled audits, one requested audit a minute."""
    server = launch(
        tmp_path_factory.mktemp("kvserve-audit-budget"),
        *TINY_FLAGS,
        *("--reuse", "any", "--recompute-strategy", "none", "--reuse-min-saving", "-10"),
        *("--audit-rate", "0", "--audit-requests-per-minute", "1"),
    )
    yield server
    stop(server)


def test_requested_audits_past_the_budget_are_skipped_and_background_work_is_reported_apart(
    budgeted_server: Server,
) -> None:
    """Issue 62.2: any client could queue background work with audit: true; the server grants
    --audit-requests-per-minute of them and the response says what became of the one it asked for.
    /v1/stats and /metrics count background sequences apart from requests."""
    client = budgeted_server.client().with_options(timeout=60)
    docs = [document(40 + i, num_words=120) for i in range(3)]
    question = "\nQuestion: which word comes up most often?\nAnswer:"

    def audit_usage(order: list[int]) -> dict:
        out = client.completions.create(
            model=TINY, prompt="\n\n".join(docs[i] for i in order) + question, max_tokens=2, temperature=0,
            extra_body={"audit": True},
        )  # fmt: skip
        return out.usage.model_extra["kvserve"]

    first = audit_usage([0, 1, 2])  # nothing cached yet: served exactly
    assert first["approx_cached_tokens"] == 0 and first["audit"] == {
        "skipped: no approximate reuse to audit": 1
    }
    second = audit_usage([2, 0, 1])
    assert second["approx_cached_tokens"] > 0 and second["audit"] == {"queued": 1}
    third = audit_usage([1, 2, 0])
    assert third["approx_cached_tokens"] > 0
    assert third["audit"] == {"skipped: over the server's budget of 1 requested audits a minute": 1}
    stats = budgeted_server.stats()
    reuse = stats["cache"]["reuse"]
    assert reuse["num_audits_requested"] == 2 and reuse["num_audits_over_budget"] == 1
    queue = stats["queue"]
    assert queue["running"] == 0 and {"background_running", "background_waiting"} <= set(queue)
    with budgeted_server.http() as h:
        metrics = h.get("/metrics").text
    for family in ("num_background_running", "num_background_waiting", "audits_over_budget_total"):
        assert f"kvserve:{family}{{" in metrics, family
