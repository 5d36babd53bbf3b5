"""Soak test: N minutes of mixed load against a real kvserve server, bounded and self-stopping.

Workers with fixed seeds send a mix of request classes (chat and completions, streamed or not,
n > 1, stop strings, logprobs, seeds, several cache salts, shared system prompts, RAG prompts of
documents in new orders with content reuse, /v1/warm pins and unpins, clients that disconnect, and
bad inputs). Every class has a set of EXPECTED outcomes; anything else is a failure, logged with its
body. A sampler records the server's RSS, /v1/stats (pool free blocks, cached blocks, queue) and
/health latency. At the end the load stops, the server is given time to go idle, and the run is
judged against issue 11's targets:

- no response other than 2xx, the expected 4xx, or 503;
- RSS growth under 5 % from the end of the first 5 minutes (1/6 of a shorter run) to the end;
- back at idle, every block is free or cached (none held by finished requests) and the pinned
  chunks are those pinned at warm-up (the pool's free blocks are back to the idle value once the
  cache's own blocks are accounted for).

Writes a JSON, a markdown table (optionally spliced into a docs page) and a PNG; exits 1 when a
target is missed, 2 when the server could not be started.

    .venv/bin/python scripts/soak.py --minutes 5
    .venv/bin/python scripts/soak.py --minutes 30 --doc docs/reliability.md --img docs/img/soak.png
    .venv/bin/python scripts/soak.py --base-url http://127.0.0.1:8000 --pid 1234 --minutes 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import percentile  # noqa: E402
from harness.texts import corpus, questions  # noqa: E402

SALTS = (None, "tenant-a", "tenant-b")
GOOD = frozenset({"200", "503"})  # 503: the bounded queue is full, by design under bursts
CLIENT_CUTS = frozenset({"disconnected", "cut"})  # the harness hung up on purpose


@dataclasses.dataclass(frozen=True)
class Kind:
    weight: int
    expected: frozenset[str]


# Outcomes are HTTP statuses ("200", "400", "503", ...) or: "disconnected" (a stream the harness
# closed after it began), "cut" (a non-streamed request the harness gave up on on purpose),
# "timeout" (no answer within the per-request timeout), "conn_error", "sse_error" (an error event
# inside a 200 stream), "no_finish" (a stream that ended without every choice finishing),
# "bad_body" (a 200 with the wrong number of choices), "<status>_no_envelope" (an error without the
# OpenAI error envelope).
KINDS: dict[str, Kind] = {
    "chat": Kind(22, GOOD),
    "chat_stream": Kind(16, GOOD),
    "completion": Kind(10, GOOD),
    "completion_stream": Kind(8, GOOD),
    "rag_any": Kind(10, GOOD),
    "rag_repeat": Kind(6, GOOD),  # a RAG prompt in a new order, then the same one again at once
    # 400: pinning it would take pins past --max-pinned-fraction of the pool (the workers pin under three
    # salts at once: on a small pool their pins together can pass it; the server says so and pins nothing)
    "warm_pin": Kind(4, GOOD | {"400"}),
    "unwarm": Kind(0, frozenset({"200"})),  # sent by warm_pin after holding its pin
    "cut_stream": Kind(5, GOOD | {"disconnected"}),
    "cut_nonstream": Kind(4, GOOD | {"cut"}),
    "burst": Kind(2, GOOD),
    "structured": Kind(3, GOOD),  # a chat whose answer must follow a JSON schema (a grammar per request)
    # --flood-clients loop it without pause: one hot system prompt whose group of the admission queue
    # never empties (issue 62's starvation); every other class must still be answered in time
    "hot_flood": Kind(0, GOOD),
    "bad_json": Kind(1, frozenset({"400"})),
    "bad_unknown_field": Kind(1, frozenset({"400"})),
    "bad_logit_bias": Kind(1, frozenset({"400", "503"})),  # out-of-vocabulary token id
    "bad_max_tokens": Kind(1, GOOD | {"400", "disconnected"}),  # 400 when the pool < context
    "bad_temperature": Kind(1, frozenset({"400"})),
    "bad_type": Kind(1, frozenset({"400"})),
    "bad_long_prompt": Kind(1, frozenset({"400", "503"})),  # over the context
    "bad_huge_prompt": Kind(1, frozenset({"400", "503"})),  # 3.5 MB of text, under the body limit
}


@dataclasses.dataclass(frozen=True)
class Texts:
    """Real text (Python's bundled docs), clipped by characters so no tokenizer is needed."""

    systems: tuple[str, ...]
    docs: tuple[tuple[str, str], ...]  # (topic, text)
    questions: tuple[str, ...]


@functools.cache
def long_text(num_chars: int) -> str:
    """The whole corpus, repeated as needed, cut to `num_chars`."""
    text = "\n\n".join(t for _, t in corpus())
    return (text * (num_chars // len(text) + 1))[:num_chars]


def build_texts(seed: int, num_systems: int = 3, num_docs: int = 10) -> Texts:
    rng = random.Random(seed)
    long = [(k, t) for k, t in corpus() if len(t) > 3000]
    picked = rng.sample(long, num_systems + num_docs)
    head = "You are a Python documentation assistant. Answer from this reference.\n\n"
    systems = tuple(f"{head}[{k}]\n{t[:2400]}" for k, t in picked[:num_systems])
    docs = tuple((k, t[: rng.randint(600, 1200)]) for k, t in picked[num_systems:])
    return Texts(systems, docs, tuple(questions(rng, 60)))


# -- the run's state ------------------------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    base_url: str  # without /v1
    pid: int | None
    timeout_s: float
    max_failures: int
    texts: Texts
    client: Any = None  # openai.AsyncOpenAI
    http: Any = None  # httpx.AsyncClient
    model: str = ""
    max_model_len: int = 0
    max_queue_size: int = 8
    only: tuple[str, ...] = ()  # restrict the mix to these classes (reproducing one defect)
    t_load: float = 0.0  # monotonic time the load began; record and sample times are relative to it
    records: list[dict] = dataclasses.field(default_factory=list)
    failures: list[dict] = dataclasses.field(default_factory=list)
    samples: list[dict] = dataclasses.field(default_factory=list)
    pins: Counter = dataclasses.field(default_factory=Counter)  # warm bodies pinned by the load

    def record(self, kind: str, outcome: str, detail: str, t0: float) -> None:
        now = time.monotonic()
        expected = outcome in KINDS[kind].expected
        self.records.append(
            {"t": now - self.t_load, "kind": kind, "outcome": outcome, "expected": expected,
             "latency_s": now - t0}
        )  # fmt: skip
        seen = sum(1 for f in self.failures if f["kind"] == kind and f["outcome"] == outcome)
        if not expected and seen < self.max_failures:
            self.failures.append(
                {"t": now - self.t_load, "kind": kind, "outcome": outcome, "detail": detail[:1500]}
            )


# -- request classes: each sends one request (or a few) and records every outcome ---------------


async def _openai(ctx: Ctx, kind: str, create: Any, num_choices: int, cut_after: int = 0, **kw: Any) -> None:
    import openai

    t0, timeout_outcome = time.monotonic(), "cut" if kind == "cut_nonstream" else "timeout"
    try:
        r = await create(model=ctx.model, **kw)
        if kw.get("stream"):
            outcome, detail = await _drain(r, num_choices, cut_after)
        else:
            ok = len(r.choices) == num_choices and all(c.finish_reason for c in r.choices)
            outcome, detail = ("200", "") if ok else ("bad_body", r.model_dump_json()[:1500])
    except openai.APIStatusError as e:
        outcome, detail = _status_outcome(e.status_code, e.response.text), e.response.text
    except openai.APITimeoutError:
        outcome, detail = timeout_outcome, f"no answer in {kw.get('timeout', ctx.timeout_s)} s"
    except openai.APIConnectionError as e:
        outcome, detail = "conn_error", repr(e.__cause__ or e)
    except openai.APIError as e:  # an error event inside a 200 stream
        outcome, detail = "sse_error", json.dumps(e.body)
    ctx.record(kind, outcome, f"{json.dumps(_brief(kw))}\n{detail}", t0)


async def _drain(stream: Any, n: int, cut_after: int) -> tuple[str, str]:
    finished: dict[int, str] = {}
    num_chunks = 0
    async for chunk in stream:
        num_chunks += 1
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        if cut_after and num_chunks >= cut_after:
            await stream.close()
            return "disconnected", ""
    if len(finished) != n:
        return "no_finish", f"{len(finished)} of {n} choices finished"
    return "200", ""


def _status_outcome(status: int, body: str) -> str:
    """The status, or "<status>_no_envelope" for an error body that is not OpenAI-shaped."""
    if status < 400:
        return str(status)
    try:
        ok = isinstance(json.loads(body)["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        ok = False
    return str(status) if ok else f"{status}_no_envelope"


def _brief(kw: dict) -> dict:
    """The request without its long texts, for failure logs."""
    out = {k: v for k, v in kw.items() if k not in ("messages", "prompt", "timeout", "text")}
    if isinstance(kw.get("messages"), list):
        out["messages"] = [{m.get("role"): len(str(m.get("content")))} for m in kw["messages"]]
    if "text" in kw:
        out["text_len"] = len(kw["text"])
    if "prompt" in kw:
        out["prompt_len"] = len(kw["prompt"])
    return out


def _sampling(rng: random.Random, lo: int = 4, hi: int = 24) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        kw["stop"] = rng.choice([["\n\n"], [".", "\n"], ["the"]])
    if rng.random() < 0.4:
        kw["seed"] = rng.randrange(10_000)
    salt = rng.choice(SALTS)
    kw["extra_body"] = {"cache_salt": salt} if salt else {}
    return kw


async def chat(ctx: Ctx, rng: random.Random, kind: str = "chat", stream: bool = False) -> None:
    system, question = rng.choice(ctx.texts.systems), rng.choice(ctx.texts.questions)
    kw = _sampling(rng)
    n = rng.choice([1, 1, 1, 2])
    if rng.random() < 0.3:
        kw.update(logprobs=True, top_logprobs=2)
    if stream and rng.random() < 0.5:
        kw["stream_options"] = {"include_usage": True}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    await _openai(ctx, kind, ctx.client.chat.completions.create, n, messages=messages, n=n,
                  stream=stream, **kw)  # fmt: skip


async def chat_stream(ctx: Ctx, rng: random.Random) -> None:
    await chat(ctx, rng, "chat_stream", stream=True)


async def completion(ctx: Ctx, rng: random.Random, kind: str = "completion", stream: bool = False) -> None:
    system, question = rng.choice(ctx.texts.systems), rng.choice(ctx.texts.questions)
    kw = _sampling(rng)
    n = rng.choice([1, 1, 2, 3])
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 3])
    elif rng.random() < 0.2:
        kw["echo"] = True
    await _openai(ctx, kind, ctx.client.completions.create, n, prompt=f"{system}\n\nQ: {question}\nA:",
                  n=n, stream=stream, **kw)  # fmt: skip


async def completion_stream(ctx: Ctx, rng: random.Random) -> None:
    await completion(ctx, rng, "completion_stream", stream=True)


def rag_messages(texts: Texts, rng: random.Random) -> list[dict[str, str]]:
    """3 or 4 documents in a new order, then a question about one of them."""
    chosen = rng.sample(texts.docs, rng.randint(3, 4))
    body = "\n\n".join(f"Document ({k}):\n{t}" for k, t in chosen)
    question = f"Using the documents, explain {rng.choice(chosen)[0].replace('-', ' ')}."
    return [
        {"role": "system", "content": "Answer the question using only the documents the user provides."},
        {"role": "user", "content": f"{body}\n\n{question}"},
    ]


async def rag_any(ctx: Ctx, rng: random.Random) -> None:
    kw = _sampling(rng)
    kw["extra_body"].update(reuse="any", recompute_strategy=rng.choice(["none", "selective", "cacheblend"]))
    await _openai(ctx, "rag_any", ctx.client.chat.completions.create, 1,
                  messages=rag_messages(ctx.texts, rng), stream=rng.random() < 0.5, **kw)  # fmt: skip


async def rag_repeat(ctx: Ctx, rng: random.Random) -> None:
    """Issue 32's livelock: a prompt served from a content hit queues its audit (with --audit-rate),
    and the same prompt sent again at once used to wait on the audit's chunks forever."""
    kw = _sampling(rng)
    kw["extra_body"].update(reuse="any", recompute_strategy=rng.choice(["none", "selective", "cacheblend"]))
    messages, stream = rag_messages(ctx.texts, rng), rng.random() < 0.5
    for _ in range(2):
        await _openai(ctx, "rag_repeat", ctx.client.chat.completions.create, 1,
                      messages=messages, stream=stream, **kw)  # fmt: skip


async def _http(ctx: Ctx, kind: str, method: str, path: str, **kw: Any) -> Any:
    import httpx

    t0 = time.monotonic()
    try:
        r = await ctx.http.request(method, path, timeout=ctx.timeout_s, **kw)
    except httpx.TimeoutException:
        ctx.record(kind, "timeout", f"{method} {path}", t0)
        return None
    except httpx.HTTPError as e:
        ctx.record(kind, "conn_error", f"{method} {path}: {e!r}", t0)
        return None
    sent = json.dumps(_brief(kw["json"])) if isinstance(kw.get("json"), dict) else ""
    ctx.record(kind, _status_outcome(r.status_code, r.text), f"{method} {path} {sent}\n{r.text}", t0)
    return r


async def warm_pin(ctx: Ctx, rng: random.Random) -> None:
    """Pin a document (under a random salt), hold the pin a few seconds, unpin it."""
    topic, text = rng.choice(ctx.texts.docs)
    body = {"text": f"Document ({topic}):\n{text}", "pin": True}
    salt = rng.choice(SALTS)
    if salt:
        body["cache_salt"] = salt
    r = await _http(ctx, "warm_pin", "POST", "/v1/warm", json=body)
    if r is None or r.status_code != 200:
        return
    key = json.dumps(body, sort_keys=True)
    ctx.pins[key] += 1
    try:
        await asyncio.sleep(rng.uniform(1.0, 6.0))
    finally:
        ctx.pins[key] -= 1
        if not ctx.pins[key]:  # a pin is a flag, not a count: unpin only when no one else holds it
            await _http(ctx, "unwarm", "DELETE", "/v1/warm", json=body)


async def cut_stream(ctx: Ctx, rng: random.Random) -> None:
    """A client that goes away after a few chunks of a stream."""
    kw = _sampling(rng, 32, 64)
    kw.pop("stop", None)
    create = rng.choice([ctx.client.chat.completions.create, ctx.client.completions.create])
    if create == ctx.client.completions.create:
        kw["prompt"] = rng.choice(ctx.texts.systems)
    else:
        kw["messages"] = [{"role": "user", "content": rng.choice(ctx.texts.systems)}]
    await _openai(ctx, "cut_stream", create, 1, cut_after=rng.randint(1, 4), stream=True, **kw)


async def cut_nonstream(ctx: Ctx, rng: random.Random) -> None:
    """A client that gives up on a non-streamed request before it can finish."""
    kw = _sampling(rng, 32, 64)
    kw.pop("stop", None)
    messages = rag_messages(ctx.texts, rng)
    await _openai(ctx, "cut_nonstream", ctx.client.chat.completions.create, 1, messages=messages,
                  timeout=rng.uniform(0.2, 1.5), **kw)  # fmt: skip


async def burst(ctx: Ctx, rng: random.Random) -> None:
    """More tiny requests at once than the queue admits: some must get 503."""
    question, create = rng.choice(ctx.texts.questions), ctx.client.completions.create
    prompts = [f"{question} ({i})" for i in range(ctx.max_queue_size + 2)]
    sends = [_openai(ctx, "burst", create, 1, prompt=p, max_tokens=2, temperature=0.0) for p in prompts]
    await asyncio.gather(*sends)


async def bad_input(ctx: Ctx, rng: random.Random, kind: str) -> None:
    msg = [{"role": "user", "content": rng.choice(ctx.texts.questions)}]
    base = {"model": ctx.model, "messages": msg, "max_tokens": 4}
    if kind == "bad_json":
        await _http(ctx, kind, "POST", "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                    headers={"Content-Type": "application/json"})  # fmt: skip
    elif kind == "bad_unknown_field":
        await _http(ctx, kind, "POST", "/v1/chat/completions", json={**base, "frobnicate": True})
    elif kind == "bad_logit_bias":
        bias = {str(rng.choice([49152, 10**6, 2**40])): 5.0}
        await _http(ctx, kind, "POST", "/v1/chat/completions", json={**base, "logit_bias": bias})
    elif kind == "bad_temperature":
        await _http(ctx, kind, "POST", "/v1/chat/completions", json={**base, "temperature": -0.5})
    elif kind == "bad_type":
        wrong = rng.choice([{"max_tokens": "many"}, {"messages": "hi"}, {"n": [2]}, {"stop": 5}])
        await _http(ctx, kind, "POST", "/v1/chat/completions", json={**base, **wrong})
    elif kind == "bad_long_prompt":
        if rng.random() < 0.5:
            ids = [rng.randrange(1000, 20000) for _ in range(ctx.max_model_len + 16)]
            await _http(ctx, kind, "POST", "/v1/completions", json={"prompt": ids, "max_tokens": 4})
        else:  # English text averages about 4 characters per token: 8 per token is safely over
            text = long_text(8 * ctx.max_model_len)
            await _http(ctx, kind, "POST", "/v1/chat/completions",
                        json={**base, "messages": [{"role": "user", "content": text}]})  # fmt: skip
    elif kind == "bad_huge_prompt":
        await _http(
            ctx, kind, "POST", "/v1/completions", json={"prompt": long_text(3_500_000), "max_tokens": 4}
        )
    elif kind == "bad_max_tokens":  # accepted only when the pool holds a whole context: then hang up
        await _openai(ctx, kind, ctx.client.completions.create, 1, cut_after=3, stream=True,
                      prompt=msg[0]["content"], max_tokens=10**9)  # fmt: skip


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer", "minimum": 0}},
    "required": ["answer"],
}


async def structured(ctx: Ctx, rng: random.Random) -> None:
    system, question = rng.choice(ctx.texts.systems), rng.choice(ctx.texts.questions)
    kw = _sampling(rng, 8, 32)
    kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    await _openai(ctx, "structured", ctx.client.chat.completions.create, 1, messages=messages,
                  stream=rng.random() < 0.5, **kw)  # fmt: skip


async def hot_flood(ctx: Ctx, rng: random.Random) -> None:
    prompt = f"{ctx.texts.systems[0]}\n\nQ: {rng.choice(ctx.texts.questions)}\nA:"
    await _openai(ctx, "hot_flood", ctx.client.completions.create, 1, prompt=prompt, max_tokens=24,
                  temperature=0.0)  # fmt: skip


ACTIONS: dict[str, Any] = {
    "chat": chat,
    "chat_stream": chat_stream,
    "completion": completion,
    "completion_stream": completion_stream,
    "rag_any": rag_any,
    "rag_repeat": rag_repeat,
    "warm_pin": warm_pin,
    "cut_stream": cut_stream,
    "cut_nonstream": cut_nonstream,
    "burst": burst,
    "hot_flood": hot_flood,
    "structured": structured,
}


async def send(ctx: Ctx, rng: random.Random, kind: str) -> None:
    """One request of the class (a few for burst and warm_pin), under the harness's own deadline."""
    t0 = time.monotonic()
    action = functools.partial(bad_input, kind=kind) if kind.startswith("bad_") else ACTIONS[kind]
    try:
        await asyncio.wait_for(action(ctx, rng), ctx.timeout_s + 30)
    except asyncio.TimeoutError:
        ctx.record(kind, "timeout", "the harness's own per-request deadline", t0)


# -- sampling the server --------------------------------------------------------------------------


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # the process is gone
        return None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


async def take_sample(ctx: Ctx) -> dict:
    s: dict[str, Any] = {"t": time.monotonic() - ctx.t_load, "rss": rss_bytes(ctx.pid)}
    t0 = time.monotonic()
    try:
        ok = (await ctx.http.get("/health", timeout=30)).status_code == 200
        s["health_s"] = time.monotonic() - t0 if ok else None
        st = (await ctx.http.get("/v1/stats", timeout=60)).json()
    except Exception as e:  # noqa: BLE001 - a failed sample is recorded, not fatal
        s["error"] = repr(e)
        return s
    c, q = st["cache"], st["queue"]
    s.update(
        free=c["blocks_total"] - c["blocks_used"], total=c["blocks_total"], cached=c["cached_blocks"],
        pinned=c["pinned_chunks"], chunks=c["chunks"], evictions=c["evictions"],
        running=q["running"], waiting=q["waiting"], in_system=q["in_system"],
        hit_tokens=c["hit_tokens"], approx_hit_tokens=c["reuse"]["num_approx_hit_tokens"],
        preemptions=q["preemptions"], counters={k: q[k] for k in
        ("rejected", "completed", "aborted", "timed_out", "errored")},
    )  # fmt: skip
    return s


async def sampler(ctx: Ctx, stop: asyncio.Event, every_s: float) -> None:
    while not stop.is_set():
        ctx.samples.append(await take_sample(ctx))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def wait_idle(ctx: Ctx, timeout_s: float) -> dict:
    """The first sample with nothing running, waiting or admitted twice in a row (or the last)."""
    deadline, quiet, s = time.monotonic() + timeout_s, 0, {}
    while time.monotonic() < deadline:
        s = await take_sample(ctx)
        idle = "error" not in s and s["running"] == s["waiting"] == s["in_system"] == 0
        quiet = quiet + 1 if idle else 0
        if quiet >= 2:
            return {**s, "idle": True}
        await asyncio.sleep(0.5)
    return {**s, "idle": False}


# -- the run --------------------------------------------------------------------------------------


def mix(ctx: Ctx) -> list[str]:
    """The classes the workers draw from (all with a weight, or those of --only)."""
    return [k for k, v in KINDS.items() if v.weight and (not ctx.only or k in ctx.only)]


async def warm_up(ctx: Ctx, seed: int) -> None:
    """Pin the first system prompt for the whole run, index the documents, then one request of every
    class in turn, so that first-use costs (a huge prompt's allocations) come before the baseline."""
    t0 = time.monotonic()
    await ctx.http.post("/v1/warm", json={"messages": [{"role": "system", "content": ctx.texts.systems[0]}]})
    for topic, text in ctx.texts.docs:
        await ctx.http.post("/v1/warm", json={"text": f"Document ({topic}):\n{text}", "pin": False})
    rng = random.Random(seed)
    for kind in mix(ctx):
        await send(ctx, rng, kind)
    print(f"warm-up done in {time.monotonic() - t0:.1f} s", flush=True)


async def worker(ctx: Ctx, rng: random.Random, stop_at: float, think_s: float) -> None:
    names = mix(ctx)
    weights = [KINDS[k].weight for k in names]
    while time.monotonic() < stop_at:
        await send(ctx, rng, rng.choices(names, weights)[0])
        await asyncio.sleep(rng.uniform(0.0, think_s))


async def flood(ctx: Ctx, rng: random.Random, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        await send(ctx, rng, "hot_flood")


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict:
    import httpx
    from openai import AsyncOpenAI

    ctx = Ctx(base_url, pid, args.request_timeout_s, args.max_failures, build_texts(args.seed))
    ctx.only = tuple(args.only.split(",")) if args.only else ()
    ctx.client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=args.request_timeout_s)  # fmt: skip
    ctx.http = httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout_s)
    card = (await ctx.http.get("/v1/models")).json()["data"][0]
    ctx.model, ctx.max_model_len = card["id"], card["max_model_len"]
    config = (await ctx.http.get("/v1/stats")).json()["config"]
    ctx.max_queue_size = config["max_queue_size"]
    ctx.t_load = time.monotonic()
    start = await take_sample(ctx)
    await warm_up(ctx, args.seed)
    idle = await wait_idle(ctx, args.idle_timeout_s)
    shift, ctx.t_load = time.monotonic() - ctx.t_load, time.monotonic()
    for x in [*ctx.records, *ctx.failures, start, idle]:  # warm-up times become negative
        x["t"] -= shift
    stop_at = ctx.t_load + args.minutes * 60
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(ctx, stop, args.sample_s))
    rngs = [random.Random(args.seed * 1009 + w) for w in range(args.workers)]
    tasks = [asyncio.create_task(worker(ctx, r, stop_at, args.think_s)) for r in rngs]
    floods = [random.Random(args.seed * 2003 + w) for w in range(args.flood_clients)]
    tasks += [asyncio.create_task(flood(ctx, r, stop_at)) for r in floods]
    _, late = await asyncio.wait(tasks, timeout=args.minutes * 60 + args.request_timeout_s + 60)
    for t in late:  # cancelling closes their connections: the server sees clients going away
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    load_s = time.monotonic() - ctx.t_load
    for key in [k for k, v in ctx.pins.items() if v]:
        await _http(ctx, "unwarm", "DELETE", "/v1/warm", json=json.loads(key))
    end = await wait_idle(ctx, args.idle_timeout_s)
    stop.set()
    await sampling
    await ctx.client.close()
    await ctx.http.aclose()
    return {
        "records": ctx.records, "failures": ctx.failures, "samples": ctx.samples,
        "start": start, "idle": idle, "end": end, "load_s": load_s, "server_config": config,
        "timeout_s": ctx.timeout_s,
    }  # fmt: skip


# -- judging (pure) ------------------------------------------------------------------------------


def rss_reference_time(load_s: float) -> float:
    """The first 5 minutes of a long run (1/6 of a shorter one) are warm-up for RSS."""
    return min(300.0, load_s / 6)


def judge(run: dict) -> dict:
    """Outcome counts, measures and the targets, from the raw run."""
    records, samples, idle, end = run["records"], run["samples"], run["idle"], run["end"]
    outcomes = Counter((r["kind"], r["outcome"]) for r in records)
    unexpected = sum(1 for r in records if not r["expected"])
    t_ref = rss_reference_time(run["load_s"])
    after = [s for s in samples if s["t"] >= t_ref and s.get("rss")]
    rss_ref, rss_end = (after[0]["rss"] if after else None), end.get("rss")
    growth = (rss_end - rss_ref) / rss_ref if rss_ref and rss_end else None
    health = [s["health_s"] for s in samples if s.get("health_s") is not None]
    held_idle, held_end = _held(idle), _held(end)
    pinned_idle, pinned_end = idle.get("pinned"), end.get("pinned")
    cuts = Counter(r["kind"] for r in records if r["outcome"] in CLIENT_CUTS)
    aborted = [(s.get("counters") or {}).get("aborted") for s in (idle, end)]
    timeout_s = run.get("timeout_s", math.inf)
    answered = [r["latency_s"] for r in records if r["outcome"] not in CLIENT_CUTS]
    slowest = max(answered, default=0.0)
    targets = [
        ("unexpected responses", str(unexpected), "0", unexpected == 0),
        ("RSS growth after warm-up", "-" if growth is None else f"{growth * 100:+.2f} %", "< 5 %",
         None if growth is None else growth < 0.05),
        ("server idle after the load", str(bool(end.get("idle"))), "True", bool(end.get("idle"))),
        ("blocks held by requests at idle (total - free - cached)", str(held_end),
         f"= after warm-up ({held_idle})", held_end is not None and held_end == held_idle),
        ("pinned chunks at idle", str(pinned_end), f"= after warm-up ({pinned_idle})",
         pinned_end is not None and pinned_end == pinned_idle),
        ("slowest answered request", f"{slowest:.1f} s", f"< half the {timeout_s:.0f} s timeout",
         slowest < timeout_s / 2),
    ]  # fmt: skip
    return {
        "outcomes": [
            {"kind": k, "outcome": o, "count": n, "expected": o in KINDS[k].expected}
            for (k, o), n in sorted(outcomes.items())
        ],
        "requests": len(records),
        "unexpected": unexpected,
        "rss": {"start": run["start"].get("rss"), "ref": rss_ref, "ref_t": t_ref, "end": rss_end,
                "peak": max((s["rss"] for s in samples if s.get("rss")), default=None), "growth": growth},
        "health_s": {"p50": percentile(health, 50), "p99": percentile(health, 99),
                     "max": max(health, default=None)},
        "client_cuts": dict(cuts),
        "server_aborted": None if None in aborted else aborted[1] - aborted[0],
        "targets": [{"target": t, "value": v, "goal": g, "met": m} for t, v, g, m in targets],
        "passed": all(m is not False for *_, m in targets),  # None: not measurable (no pid)
    }  # fmt: skip


def _held(s: dict) -> int | None:
    """Blocks owned by neither the free list nor the cache: held by requests (0 when idle)."""
    return s["total"] - s["free"] - s["cached"] if "free" in s else None


# -- report ---------------------------------------------------------------------------------------

START, END = "<!-- soak:start -->", "<!-- soak:end -->"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def markdown(result: dict, image: str | None = None) -> str:
    j, m, run = result["judged"], result["meta"], result["run"]
    start, idle, end, r, h = run["start"], run["idle"], run["end"], j["rss"], j["health_s"]
    cuts = j["client_cuts"]
    flood = f" and {m['flood_clients']} flood clients" if m.get("flood_clients") else ""
    lines = [
        f"Run {m['started']}, {run['load_s'] / 60:.1f} minutes of load, {j['requests']} requests, "
        f"{m['workers']} workers{flood}; machine: {m['cpu']}, {m['cores']} cores. Command: `{m['command']}`. "
        f"Server: `{m['server']}`.",
        "",
        "| target | value | goal | met |",
        "|---|---|---|---|",
    ]
    for t in j["targets"]:
        met = "-" if t["met"] is None else "yes" if t["met"] else "**no**"
        lines.append(f"| {t['target']} | {t['value']} | {t['goal']} | {met} |")
    lines += [
        "",
        "| measure | before warm-up | idle after warm-up | at the RSS reference | end (idle) |",
        "|---|---|---|---|---|",
        f"| server RSS (MiB) | {_mib(r['start'])} | {_mib(idle.get('rss'))} "
        f"| {_mib(r['ref'])} (t = {r['ref_t']:.0f} s) | {_mib(r['end'])} (peak {_mib(r['peak'])}) |",
    ]
    for label, key in (
        ("pool free blocks", "free"),
        ("cached blocks", "cached"),
        ("pinned chunks", "pinned"),
        ("evictions", "evictions"),
        ("preemptions", "preemptions"),
        ("exact prefix hit tokens", "hit_tokens"),
        ("approximate (content) hit tokens", "approx_hit_tokens"),
    ):
        lines.append(f"| {label} | {start.get(key)} | {idle.get(key)} | - | {end.get(key)} |")
    lines += ["", f"Pool: {end.get('total')} blocks. /health latency during the load: p50 {_ms(h['p50'])} ms, "
              f"p99 {_ms(h['p99'])} ms, max {_ms(h['max'])} ms. Client hang-ups: "
              + (", ".join(f"{k} {v}" for k, v in sorted(cuts.items())) or "none")
              + f"; server-side aborts over the load: {j['server_aborted']}. Server counters at the end: "
              + ", ".join(f"{k} {v}" for k, v in (end.get("counters") or {}).items())
              + f". ERROR lines in the server log: {m.get('server_log_error_lines', '-')}.", "",
              "| class | outcome | count | expected |", "|---|---|---|---|"]  # fmt: skip
    for o in j["outcomes"]:
        lines.append(
            f"| {o['kind']} | {o['outcome']} | {o['count']} | {'yes' if o['expected'] else '**no**'} |"
        )
    if run["failures"]:
        lines += ["", "Unexpected outcomes (the first of each kind):", ""]
        firsts = {(f["kind"], f["outcome"]): f for f in reversed(run["failures"])}
        for (kind, outcome), f in sorted(firsts.items()):
            detail = " ".join(f["detail"].split())[:300].replace("|", "/")
            lines.append(f"- {kind} -> {outcome} at t = {f['t']:.0f} s: `{detail}`")
    if image:
        lines += ["", f"![soak run]({image})"]
    return "\n".join(lines)


def plot(result: dict, path: Path, bin_s: float = 10.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = result["run"]
    samples = sorted([run["start"], run["idle"], *run["samples"], run["end"]], key=lambda s: s["t"])
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    with_rss = [s for s in samples if s.get("rss")]
    ax1.plot([s["t"] / 60 for s in with_rss], [s["rss"] / 2**20 for s in with_rss], marker=".")
    ax1.axvline(0, color="black", lw=0.8)
    ref_t = result["judged"]["rss"]["ref_t"] / 60
    ax1.axvline(ref_t, color="gray", ls="--", label="RSS reference (end of warm-up)")
    ax1.set(ylabel="server RSS (MiB)", title="soak: memory, pool and outcomes over time")
    ax1.legend(fontsize=8)
    pool = [s for s in samples if "free" in s]
    t = [s["t"] / 60 for s in pool]
    ax2.plot(t, [s["free"] for s in pool], label="free blocks")
    ax2.plot(t, [s["cached"] for s in pool], label="cached blocks")
    ax2.plot(t, [s["total"] - s["free"] - s["cached"] for s in pool], label="held by requests")
    ax2.axvline(0, color="black", lw=0.8)
    ax2.set(ylabel="blocks")
    ax2.legend(fontsize=8)
    cats = ("2xx", "expected 4xx", "503", "client cut", "unexpected")
    n_bins = max(1, math.ceil(run["load_s"] / bin_s))
    counts = {c: [0.0] * n_bins for c in cats}
    for r in run["records"]:
        if 0 <= r["t"]:
            counts[_category(r)][min(int(r["t"] // bin_s), n_bins - 1)] += 1
    widths = [min(bin_s, run["load_s"] - i * bin_s) or bin_s for i in range(n_bins)]
    bottom = [0.0] * n_bins
    for c, color in zip(cats, ("C2", "C1", "C7", "C9", "C3")):
        rates = [n / w for n, w in zip(counts[c], widths)]
        ax3.bar([i * bin_s / 60 for i in range(n_bins)], rates, [w / 60 for w in widths], bottom,
                align="edge", color=color, label=c)  # fmt: skip
        bottom = [b + r for b, r in zip(bottom, rates)]
    ax3.set(
        xlabel="minutes since the load began (negative: warm-up)", ylabel=f"requests/s ({bin_s:.0f} s bins)"
    )
    ax3.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _category(r: dict) -> str:
    if not r["expected"]:
        return "unexpected"
    if r["outcome"] in CLIENT_CUTS:
        return "client cut"
    if r["outcome"] == "503":
        return "503"
    return "expected 4xx" if r["outcome"].startswith("4") else "2xx"


def splice(doc: Path, section: str) -> None:
    """Replace the text between the soak markers of `doc` (appended when they are missing)."""
    text = doc.read_text() if doc.exists() else "# Reliability\n"
    if START not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    doc.write_text(f"{head}{START}\n{section}\n{END}{rest.split(END, 1)[1]}")


# -- main -----------------------------------------------------------------------------------------


def server_argv(args: argparse.Namespace) -> tuple[str, ...]:
    codec = ("--kv-cache-dtype", args.kv_cache_dtype) if args.kv_cache_dtype else ("--kv-cache-bits", str(args.kv_cache_bits))  # fmt: skip
    return (
        sys.executable, "-m", "kvserve.cli", "--model", args.model, "--port", "{port}", *codec,
        "--reuse", args.reuse, "--max-cache-bytes", str(args.max_cache_bytes),
        "--max-queue-size", str(args.max_queue_size), "--request-timeout-s", str(args.server_timeout_s),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--audit-rate", str(args.audit_rate),
        "--log-level", "warning",
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_errors(log_path: Path) -> list[str]:
    if not log_path.exists():
        return []
    lines = log_path.read_text(errors="replace").splitlines()
    return [ln for ln in lines if "ERROR" in ln or ln.startswith("Traceback")]


def watchdog(limit_s: float, pid: int | None) -> threading.Timer:
    """Last resort past the hard deadline: kill the server's process group and exit."""

    def fire() -> None:
        print(f"soak: hard deadline of {limit_s:.0f} s passed; stopping", file=sys.stderr, flush=True)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os._exit(3)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_against(args: argparse.Namespace, base_url: str, pid: int | None, own: bool) -> dict:
    limit = args.minutes * 60 + args.request_timeout_s + 2 * args.idle_timeout_s + 300
    timer = watchdog(limit + 60, pid if own else None)
    try:
        return asyncio.run(asyncio.wait_for(soak(args, base_url, pid), limit))
    except asyncio.TimeoutError:
        sys.exit(f"soak: the run passed its hard deadline of {limit:.0f} s; no report")
    finally:
        timer.cancel()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Soak a kvserve server with mixed load; judge issue 11's targets."
    )
    p.add_argument("--minutes", type=float, default=5.0, help="length of the load")
    p.add_argument("--base-url", help="attach to this running server (no /v1) instead of starting one")
    p.add_argument("--pid", type=int, help="with --base-url: the server's pid, for RSS")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-bits", type=int, default=8)
    p.add_argument("--kv-cache-dtype", help="a codec by name (overrides --kv-cache-bits)")
    p.add_argument("--reuse", default="prefix", choices=["prefix", "any"],
                   help="server default; RAG requests always ask for reuse=any")  # fmt: skip
    p.add_argument("--max-cache-bytes", type=int, default=32_000_000, help="small: eviction, preemption")
    p.add_argument("--audit-rate", type=float, default=0.0, help="the online audit of content reuse (0-1)")
    p.add_argument("--max-queue-size", type=int, default=6, help="small: bursts get 503")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="small: prompts are prefilled in pieces, admitted with part of their blocks, "
                   "so a small pool must preempt")  # fmt: skip
    p.add_argument("--server-timeout-s", type=float, default=300.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--flood-clients", type=int, default=0,
                   help="clients looping requests over one hot system prompt, without pause")  # fmt: skip
    p.add_argument("--think-s", type=float, default=0.5, help="most idle time between a worker's requests")
    p.add_argument("--request-timeout-s", type=float, default=180.0)
    p.add_argument("--idle-timeout-s", type=float, default=90.0)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated classes: send only these (default: the whole mix)")
    p.add_argument("--max-failures", type=int, default=5, help="bodies kept per (class, outcome)")
    p.add_argument("--out", type=Path, default=Path("out/soak/soak.json"))
    p.add_argument("--img", type=Path, default=Path("out/soak/soak.png"))
    p.add_argument("--doc", type=Path, help="splice the table and plot into this markdown page")
    p.add_argument("--report", type=Path, help="only redraw the table, plot and doc from this JSON")
    args = p.parse_args()
    unknown = set(args.only.split(",")) - set(KINDS) if args.only else set()
    if unknown:
        p.error(f"unknown classes {sorted(unknown)}; known: {', '.join(KINDS)}")
    return args


def run_soak(args: argparse.Namespace) -> dict | None:
    """Start (or attach to) the server, soak it, return the result; None if it did not start."""
    from harness.machine import machine
    from peers.launch import System, running

    log_path = args.out.with_suffix(".server.log")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if args.base_url:
        server, run = args.base_url, run_against(args, args.base_url.rstrip("/"), args.pid, own=False)
    else:
        server = " ".join(server_argv(args)[1:]).replace("{port}", "PORT")
        t0 = time.monotonic()
        try:
            with running(System("kvserve-soak", server_argv(args)), free_port(), log_path) as (pid, url):
                print(f"server ready in {time.monotonic() - t0:.1f} s (log: {log_path})", flush=True)
                run = run_against(args, url.removesuffix("/v1"), pid, own=True)
        except RuntimeError as e:
            print(f"soak: the server did not start: {e}", file=sys.stderr)
            return None
    mach, errors = machine(), log_errors(log_path)
    meta = {"started": started, "command": " ".join(["python", *sys.argv]), "server": server,
            "workers": args.workers, "flood_clients": args.flood_clients, "cpu": mach["cpu"], "cores": mach["cores"], "machine": mach,
            "server_log_error_lines": len(errors), "server_log_errors": errors[:50]}  # fmt: skip
    return {"meta": meta, "run": run, "judged": judge(run)}


def main() -> int:
    args = parse_args()
    if args.report:
        result = json.loads(args.report.read_text())
        result["judged"] = judge(result["run"])
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = run_soak(args)
        if result is None:
            return 2
        args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.img)
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    if args.doc:
        splice(args.doc, markdown(result, os.path.relpath(args.img, args.doc.parent)))
    print(f"\nwrote {args.out}, {args.out.with_suffix('.md')} and {args.img}")
    return 0 if result["judged"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
