"""GET /dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver, which
`make setup` installs) driven by selenium against a live server with --api-key. The page asks for the
key, then follows traffic live, and what it shows equals /v1/stats. The test saves the screenshot that
docs/server.md shows (docs/img/dashboard.png)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.stat_table import STATS
from tests.e2e.conftest import ROOT, TINY, Server, launch, stop, wait_until

KEY = "dashboard-key"
WAVES = 5
SCREENSHOT = ROOT / "docs" / "img" / "dashboard.png"
# Chromium in a closed network: no background fetches, no component updates (background.md notes)
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--window-size=1400,2900",
)


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        f"the dashboard test needs {' or '.join(names)} and found none on PATH: run `make setup` (it installs "
        "Debian's chromium and chromium-driver) or `apt-get install chromium chromium-driver`"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # a pool of ~180 blocks, so that the traffic below fills a visible share of it
    # approximate reuse on and every such request audited, so the page's reuse and KL parts have data
    # and a cold tier, so that evicted chunks come back from it
    flags = (
        "--model",
        TINY,
        "--max-cache-bytes",
        "3000000",
        "--reuse",
        "any",
        "--recompute-strategy",
        "selective",
    )
    flags += ("--audit-rate", "1.0")
    flags += ("--kv-cold-bytes", "20000000")
    s = launch(tmp_path_factory.mktemp("kvserve-dashboard"), *flags, api_key=KEY)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:  # never a silent skip: the test fails and says what is missing
        pytest.fail(f"selenium is not installed ({e}): run `make setup`")
    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(_binary("chromedriver")))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def text(browser: Any, element_id: str) -> str:
    return str(browser.execute_script(f"return document.getElementById('{element_id}').textContent"))


def number(browser: Any, element_id: str) -> int:
    return int(text(browser, element_id).replace(",", ""))


def visible(browser: Any, element_id: str) -> bool:
    return not browser.execute_script(f"return document.getElementById('{element_id}').hidden")


def test_the_page_needs_the_api_key(server: Server, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(server.base_url + "/dashboard")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    assert wait_until(lambda: visible(browser, "key-form"), 10), "no key form without a key"
    assert not visible(browser, "board")
    field = browser.find_element(By.ID, "key")
    field.send_keys("wrong-key")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    assert wait_until(lambda: "invalid API key" in text(browser, "key-error"), 10), text(browser, "key-error")
    assert not visible(browser, "board")
    field.clear()
    field.send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    assert wait_until(lambda: visible(browser, "board") and not visible(browser, "key-form"), 10)


def _doc(seed: int) -> list[int]:
    return [(7 * i + 13 * seed) % 500 + 3 for i in range(3 * 128)]  # three chunks


def _traffic(server: Server) -> int:
    """Waves of requests a second apart, over documents that come back (so later requests hit the
    cache), new ones (computed) and a warmed, pinned prefix; returns how many requests ran."""
    with server.http() as h:
        r = h.post("/v1/warm", json={"prompt_token_ids": _doc(99)[:256]})
        assert r.status_code == 200, r.text
    client = server.client()

    def ask(prompt: list[int]) -> None:
        client.completions.create(model="tiny-random-llama", prompt=prompt, max_tokens=24, temperature=0)

    sent = 0
    for wave in range(WAVES):
        prompts = [_doc(wave) + [11], _doc(0) + [12 + wave], _doc(max(0, wave - 1)) + [40 + wave]]
        if wave % 2:
            prompts.append(_doc(99)[:256] + [60 + wave])  # reuses the pinned prefix
        else:
            prompts.append(list(range(400 + wave, 460 + wave)) + _doc(0))  # a known document, moved
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sent += len(prompts)
        time.sleep(1.0)
    flood, back = range(20, 26), (1, 2)
    for seed in flood:  # new documents, which evict the older ones into the cold tier
        ask(_doc(seed) + [90])
    time.sleep(1.0)
    for seed in back:  # and two of those come back: loaded from it
        ask(_doc(seed) + [91])
    return sent + len(flood) + len(back)


def test_the_page_follows_traffic_and_matches_stats(server: Server, browser: Any) -> None:
    browser.get(server.base_url + "/dashboard")
    browser.execute_script("sessionStorage.setItem('kvserve-api-key', arguments[0])", KEY)
    browser.refresh()
    assert wait_until(lambda: visible(browser, "board"), 10)
    sent = _traffic(server)
    # the charts show it: exact reuse in the token series, every request in the TTFT histogram
    assert wait_until(lambda: browser.execute_script("return Math.max(...history.exact) > 0"), 15)
    script = "return charts.ttft.data[1].reduce((a, b) => a + b, 0)"
    assert wait_until(lambda: browser.execute_script(script) >= sent, 15)

    stats = wait_until(lambda: _settled(server), 20)
    assert stats, "the server's stats did not settle"

    def shown() -> dict[str, Any]:
        return {
            "running": number(browser, "running"),
            "waiting": number(browser, "waiting"),
            "hit_tokens": number(browser, "hit-tokens"),
            "query_tokens": number(browser, "query-tokens"),
            "computed": number(browser, "tok-computed"),
            "exact": number(browser, "tok-exact"),
            "approx": number(browser, "tok-approx"),
            "blocks": {k: number(browser, f"blocks-{k}") for k in ("in_use", "pinned", "evictable", "free")},
            "chunks": number(browser, "chunks"),
            "hit_rate": text(browser, "hit-rate"),
            "top": browser.execute_script(
                "return [...document.querySelectorAll('#top-chunks tbody tr')]"
                ".map(r => [r.cells[0].textContent, r.cells[3].textContent, r.cells[4].textContent])"
            ),
            "sources": browser.execute_script(
                "return [...document.querySelectorAll('#sources tbody tr')]"
                ".map(r => [r.cells[0].textContent, r.cells[1].textContent])"
            ),
            "audited": browser.execute_script(
                "return [...document.querySelectorAll('#audit tbody tr')]"
                ".map(r => [r.cells[0].textContent, r.cells[1].textContent])"
            ),
            "ttft": browser.execute_script("return charts.ttft.data[1]"),
            "itl": browser.execute_script("return charts.itl.data[1]"),
            "numbers": browser.execute_script(
                "return [...document.querySelectorAll('#numbers tbody tr')]"
                ".map(r => [r.cells[0].textContent, r.cells[1].textContent, r.cells[3].textContent])"
            ),
        }

    cache, chunk = stats["cache"], stats["config"]["chunk_size"]
    want = {
        "running": stats["queue"]["running"],
        "waiting": stats["queue"]["waiting"],
        "hit_tokens": cache["hit_tokens"],
        "query_tokens": cache["query_tokens"],
        "computed": stats["tokens"]["prompt_tokens_computed"],
        "exact": cache["hit_tokens"],
        "approx": cache["reuse"]["num_approx_hit_tokens"],
        "blocks": cache["occupancy_blocks"],
        "chunks": cache["chunks"],
        "hit_rate": f"{100 * cache['hit_rate']:.1f} %",
        "top": [
            [c["chunk_hash"], f"{c['num_hits']:,}", "yes" if c["pinned"] else "no"]
            for c in cache["top_chunks"]
        ],
        "sources": [
            ["computed", f"{stats['tokens']['prompt_tokens_computed']:,}"],
            ["reused exactly (the hot pool)", f"{cache['hit_tokens']:,}"],
            ["reused approximately (content match)", f"{cache['reuse']['num_approx_hit_tokens']:,}"],
        ]
        + [
            [f"\xa0\xa0of those exactly, loaded from the {tier} tier", f"{row['loads'] * chunk:,}"]
            for tier, row in cache["tiers"].items()
            if tier != "hot"
        ],
        "audited": [[name, f"{a['num_audited']:,}"] for name, a in cache["reuse"]["audit"].items()],
        "ttft": stats["latency"]["histograms"]["ttft_s"]["counts"],
        "itl": stats["latency"]["histograms"]["inter_token_s"]["counts"],
        # "All numbers": every declared /v1/stats number, listed from the table (kvserve/stat_table.py)
        "numbers": [[s.path, _shown_value(stats, s.path, s.unit), s.help] for s in STATS if s.path],
    }
    got = wait_until(lambda: (s := shown()) == want and s, 10) or shown()
    assert got == want
    # what the traffic must have produced, so that the comparison above is not of zeros
    assert want["exact"] > 0 and want["blocks"]["pinned"] > 0 and want["blocks"]["evictable"] > 0
    assert want["approx"] > 0 and want["audited"], cache["reuse"]
    assert cache["tiers"]["cold"]["loads"] > 0, cache["tiers"]
    assert sum(want["ttft"]) >= sent and sum(b == "yes" for _, _, b in want["top"]) > 0
    assert sum(want["blocks"].values()) == cache["blocks_total"]
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 20_000


def _shown_value(stats: dict[str, Any], path: str, unit: str) -> str:
    """A number as dashboard.js's fmtValue writes it."""
    section, key = path.split(".")
    value = stats[section][key]
    if isinstance(value, str):
        return value
    if unit == "ratio":
        return f"{100 * value:.1f} %"
    return f"{int(value):,}" if float(value).is_integer() else f"{value:.3f}"


def _settled(server: Server) -> dict[str, Any] | None:
    """/v1/stats once nothing runs and two reads agree (the engine publishes its snapshot after steps)."""
    first = server.stats()
    if first["queue"]["running"] or first["queue"]["waiting"]:
        return None
    second = server.stats()
    keys = ("cache", "tokens", "queue")
    same = all(_strip(first[k]) == _strip(second[k]) for k in keys) and first["latency"] == second["latency"]
    return second if same else None


def _strip(d: dict[str, Any]) -> Any:
    """Without the idle times, which move between reads."""
    if "top_chunks" not in d:
        return d
    return {**d, "top_chunks": [{k: v for k, v in c.items() if k != "idle_s"} for c in d["top_chunks"]]}


def test_static_files_are_open_and_data_is_not(server: Server) -> None:
    import httpx

    open_paths = ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/uPlot.iife.min.js")
    for path in (*open_paths, "/dashboard/fields.json"):
        assert httpx.get(server.base_url + path).status_code == 200, path
    assert httpx.get(server.base_url + "/v1/stats").status_code == 401
    assert httpx.get(server.base_url + "/dashboard/static/../../v1/stats").status_code in (401, 404)
    assert (
        Path(ROOT / "kvserve" / "api" / "dashboard" / "uPlot.LICENSE")
        .read_text()
        .startswith("The MIT License")
    )


def test_the_page_says_when_the_chunk_rows_are_withheld(server: Server, browser: Any) -> None:
    """Issue 62.5: once a request uses cache_salt (tenants), /v1/stats withholds the per-chunk rows
    (no --admin-api-key here) and the table says so instead of "nothing cached yet". Last in the
    module: the server withholds them from then on."""
    browser.get(server.base_url + "/dashboard")
    browser.execute_script("sessionStorage.setItem('kvserve-api-key', arguments[0])", KEY)
    browser.refresh()
    server.client().completions.create(
        model=TINY, prompt=_doc(7), max_tokens=1, extra_body={"cache_salt": "t1"}
    )
    withheld = server.stats()["cache"]["top_chunks_withheld"]
    assert withheld and "cache_salt" in withheld

    def first_row() -> str:
        return str(
            browser.execute_script("return document.querySelector('#top-chunks tbody tr').textContent")
        )

    assert wait_until(lambda: first_row() == f"hidden: {withheld}", 10), first_row()
