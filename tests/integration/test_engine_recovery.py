"""After a step that raises (a bug), the engine checks its books and rebuilds its state where they
disagree (issue 62, item 3): the app `kvserve serve` builds (create_app over LocalBackend over an
AsyncEngine), in process so that a fault can be injected into the engine's update, and the real OpenAI
client over it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.api.backend import LocalBackend
from kvserve.api.server import create_app
from kvserve.config import ServeConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.integrity import IntegrityError
from kvserve.metrics import Metrics
from kvserve.request import Request
from kvserve.reuse.audit import Trace
from kvserve.tiers.loads import LoadJob
from tests.integration.helpers import corpus_token_ids

TINY = "tiny-random-llama"
CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def config(disk_dir: Path) -> ServeConfig:
    return ServeConfig(model=TINY, chunk_size=CHUNK, max_cache_bytes=16_000_000, kv_disk_dir=str(disk_dir))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A fresh engine of the same configuration: what every answer must equal."""
    return LLM(config=config(tmp_path_factory.mktemp("reference-disk")))


@pytest.fixture(scope="module")
def prompts(reference: LLM) -> dict[str, list[int]]:
    return {
        "pinned": corpus_token_ids(reference, 2 * CHUNK, seed=1),
        "question": corpus_token_ids(reference, 3 * CHUNK + 4, seed=2),
    }


@dataclass
class Served:
    engine: Engine
    http: TestClient
    client: openai.OpenAI


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[Served]:
    cfg = config(tmp_path / "disk")
    engine = Engine(cfg)
    engine.check_integrity_each_step = True  # a step after the recovery that finds a leak raises again
    metrics = Metrics(cfg.model, engine.info.max_model_len)
    async_engine = AsyncEngine(engine, cfg.max_queue_size, observer=metrics.observe)
    async_engine.start()
    with TestClient(create_app(cfg, LocalBackend(async_engine, metrics, cfg))) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield Served(engine, http, client)


def fail_once(obj: Any, name: str, at_call: int) -> None:
    """Make `obj.name` raise RuntimeError at its `at_call`-th call from now on (once), before it runs."""
    real = getattr(obj, name)
    calls = 0

    def faulty(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == at_call:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    setattr(obj, name, faulty)


def healthy(served: Served, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while served.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not recover"
        time.sleep(0.02)


def complete(served: Served, prompt: list[int]) -> openai.types.Completion:
    return served.client.completions.create(model=TINY, prompt=prompt, max_tokens=8, temperature=0)


def stats_of(served: Served) -> dict[str, Any]:
    stats: dict[str, Any] = served.http.get("/v1/stats").json()
    return stats


def test_a_step_that_breaks_the_pool_is_rebuilt_and_answers_like_a_fresh_engine(
    served: Served, reference: LLM, prompts: dict[str, list[int]]
) -> None:
    """The fault: the second chunk a prefill commits raises in ChunkStore.insert, after the manager
    took the store's pool refs on its blocks and after the first chunk was committed: refs no owner
    holds. The engine fails the request, finds the pool's books off, rebuilds (the pinned text warmed
    again from the disk tier) and then answers as a fresh engine does, with sound books after every
    step."""
    r = served.http.post("/v1/warm", json={"prompt_token_ids": prompts["pinned"], "pin": True})
    assert r.status_code == 200 and r.json()["num_new_chunks"] == 2
    fail_once(served.engine.store, "insert", at_call=2)
    with pytest.raises(openai.InternalServerError, match="internal error"):
        complete(served, prompts["question"])
    healthy(served)
    answer = complete(served, prompts["question"])
    (fresh,) = reference.generate([prompts["question"]], GREEDY)
    assert answer.choices[0].text == fresh.text
    stats = stats_of(served)
    queue, cache = stats["queue"], stats["cache"]
    assert (queue["step_failures"], queue["engine_restarts"]) == (1, 1)  # every step since checked whole
    assert "pool ref counts do not match owners" in queue["last_restart_reason"]
    assert queue["last_restart_reason"].startswith("RuntimeError in a step")
    assert cache["pinned_chunks"] == 2 and cache["tiers"]["disk"]["loads"] >= 2  # warmed again from disk
    unpinned = served.http.request("DELETE", "/v1/warm", json={"prompt_token_ids": prompts["pinned"]})
    assert unpinned.json()["num_unpinned_chunks"] == 2  # pinned again under the owner the client names
    families = {f.name: f for f in text_string_to_metric_families(served.http.get("/metrics").text)}
    assert [x.value for x in families["kvserve:engine_restarts"].samples] == [1.0]
    assert [x.value for x in families["kvserve:engine_step_failures"].samples] == [1.0]


def test_a_step_failure_that_leaves_the_books_whole_keeps_the_cache(
    served: Served, reference: LLM, prompts: dict[str, list[int]]
) -> None:
    """The fault after every item of the step advanced the books (the grammar masks, before
    sampling): the request fails, the books agree, nothing is rebuilt and the chunks the failed step
    registered serve the next request."""
    fail_once(served.engine.update, "_grammar_masks", at_call=1)
    with pytest.raises(openai.InternalServerError, match="internal error"):
        complete(served, prompts["question"])
    healthy(served)
    answer = complete(served, prompts["question"])
    (fresh,) = reference.generate([prompts["question"]], GREEDY)
    assert answer.choices[0].text == fresh.text
    assert answer.usage.prompt_tokens_details.cached_tokens == 3 * CHUNK
    queue = stats_of(served)["queue"]
    assert (queue["step_failures"], queue["engine_restarts"], queue["last_restart_reason"]) == (1, 0, "")


def test_health_and_requests_are_503_while_the_engine_rebuilds(
    served: Served, prompts: dict[str, list[int]]
) -> None:
    released = threading.Event()
    real_reset = served.engine.kv.reset

    def held_reset() -> None:
        assert released.wait(30), "the test never released the rebuild"
        real_reset()

    served.engine.kv.reset = held_reset  # type: ignore[method-assign]
    fail_once(served.engine.store, "insert", at_call=2)
    with pytest.raises(openai.InternalServerError):
        complete(served, prompts["question"])  # failed before the rebuild, which now waits
    try:
        r = served.http.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "recovering" and "recovering from an internal error" in error["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            complete(served, prompts["question"])
        assert refused.value.status_code == 503 and refused.value.code == "recovering"
    finally:
        released.set()
    healthy(served)
    assert complete(served, prompts["question"]).choices[0].finish_reason == "length"
    assert stats_of(served)["queue"]["engine_restarts"] == 1


def test_a_recovery_that_fails_refuses_every_request_for_good(
    served: Served, prompts: dict[str, list[int]]
) -> None:
    def broken_recover(exc: Exception) -> bool:
        raise RuntimeError("the rebuild itself failed")

    served.engine.recover = broken_recover  # type: ignore[method-assign]
    fail_once(served.engine.update, "_grammar_masks", at_call=1)
    with pytest.raises(openai.InternalServerError):
        complete(served, prompts["question"])
    deadline = time.monotonic() + 30
    while "must be restarted" not in (r := served.http.get("/health")).json()["error"]["message"]:
        assert r.status_code == 503 and time.monotonic() < deadline  # recovering, then broken for good
        time.sleep(0.02)
    assert r.status_code == 503
    with pytest.raises(openai.APIStatusError) as refused:
        complete(served, prompts["question"])
    assert refused.value.status_code == 503


# --- check_integrity names what leaked -------------------------------------------------------------
def _leak_trace(engine: Engine) -> Callable[[], None]:
    engine.reuse.auditor.tracing["gone"] = Trace("selective", [], False)
    return lambda: engine.reuse.auditor.tracing.pop("gone")


def _leak_tier_load(engine: Engine) -> Callable[[], None]:
    assert engine.tiers is not None
    engine.tiers._loading["gone"] = LoadJob(None, [])
    return lambda: engine.tiers.forget("gone")  # type: ignore[union-attr]


def _leak_repair(engine: Engine) -> Callable[[], None]:
    engine.reuse.repairs._by_request["gone"] = None  # type: ignore[assignment]
    return lambda: engine.reuse.repairs.drop("gone")


def _leak_pin_booking(engine: Engine) -> Callable[[], None]:
    """A booking in the store's pin budget that no request's record holds."""
    assert engine.kv.book_pins(1)
    return lambda: engine.kv.unbook_pins(1)


def _leak_pool_ref(engine: Engine) -> Callable[[], None]:
    block = engine.store.chunks()[0].block_ids[0]
    engine.pool.ref_counts[block] += 1
    return lambda: engine.pool.ref_counts.__setitem__(block, engine.pool.ref_counts[block] - 1)


@pytest.mark.parametrize(
    ("leak", "named"),
    [
        (_leak_trace, "audit traces kept for requests that are gone (gone)"),
        (_leak_tier_load, "tier loads kept for requests that are gone (gone)"),
        (_leak_repair, "repairs kept for requests that are gone (gone)"),
        (_leak_pin_booking, "warm pins: pin reservations do not match the warms"),
        (_leak_pool_ref, "scheduler and KV cache: pool ref counts do not match owners"),
    ],
    ids=["audit", "tiers", "repairs", "pins", "pool"],
)
def test_check_integrity_names_the_table_that_leaked(
    reference: LLM, prompts: dict[str, list[int]], leak: Callable[[Engine], Callable[[], None]], named: str
) -> None:
    engine = reference.engine
    reference.generate([prompts["question"]], GREEDY)
    engine.check_integrity()
    undo = leak(engine)
    try:
        with pytest.raises(IntegrityError) as raised:
            engine.check_integrity()
        assert named in str(raised.value), raised.value.problems
    finally:
        undo()
    engine.check_integrity()


def test_a_request_that_ends_while_it_waits_for_a_tier_load_leaves_no_entry(
    reference: LLM, prompts: dict[str, list[int]]
) -> None:
    """A request aborted while a load from a KV tier runs for it: its entry in the tiers' loading set
    went only when the load ended, a table kept for a request that is gone."""
    engine = reference.engine
    assert engine.tiers is not None
    engine.add_request(Request("waits", prompts["question"], GREEDY))
    engine.tiers._loading["waits"] = LoadJob(None, [])  # its lookup found chunks on disk: they load
    assert engine.abort_request("waits")
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
