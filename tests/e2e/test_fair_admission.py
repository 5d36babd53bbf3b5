"""Fair admission (issue 62, item 1): a prompt whose prefix is not the popular one is served about as
soon as first come, first served would serve it, while clients keep the popular prefix's group of the
admission queue from ever emptying (before the fix it waited until they stopped)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import TINY_FLAGS, Server, launch, stop

HOT_CLIENTS = 6
FLOOD_LIMIT_S = 30.0  # the hot clients stop by then at the latest (the old queue served the minority then)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = launch(Path(tmp_path_factory.mktemp("kvserve-fair")), *TINY_FLAGS, "--max-num-seqs", "2")
    yield server
    stop(server)


def test_a_minority_prefix_is_not_starved_by_a_hot_one(server: Server) -> None:
    system = " ".join(f"rule {i}: answer briefly." for i in range(80))  # about 400 tokens, shared
    client = server.client()
    stop_flood = threading.Event()
    hot_latencies: list[tuple[float, float]] = []  # (finished at, latency)
    errors: list[BaseException] = []

    def hot(worker: int) -> None:
        k = 0
        while not stop_flood.is_set():
            k += 1
            t0 = time.monotonic()
            try:
                client.completions.create(
                    model="tiny-random-llama",
                    prompt=f"{system}\nQuestion {worker}.{k}: why?",
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            hot_latencies.append((time.monotonic(), time.monotonic() - t0))

    threads = [threading.Thread(target=hot, args=(w,), daemon=True) for w in range(HOT_CLIENTS)]
    for t in threads:
        t.start()
    timer = threading.Timer(FLOOD_LIMIT_S, stop_flood.set)
    timer.start()
    try:
        time.sleep(3.0)  # the hot group is never empty from here on
        t0 = time.monotonic()
        out = client.completions.create(
            model="tiny-random-llama",
            prompt="A different prefix entirely: count to three.",
            max_tokens=8,
            temperature=0,
        )
        served_at = time.monotonic()
        minority_latency = served_at - t0
        time.sleep(0.5)
    finally:
        stop_flood.set()
        timer.cancel()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert out.choices[0].text is not None
    during = [lat for done, lat in hot_latencies if t0 <= done <= served_at]
    assert any(done > served_at for done, _ in hot_latencies), "the flood had stopped: nothing was measured"
    assert during, "no hot request finished while the minority one waited"
    # first come, first served would serve it after the (at most HOT_CLIENTS) requests ahead of it: about
    # one hot request's latency; allow 3x that, and never the flood's whole length
    hot_p50 = statistics.median(lat for _, lat in hot_latencies)
    assert minority_latency <= 3 * hot_p50 + 1.0, (minority_latency, hot_p50, len(hot_latencies))
