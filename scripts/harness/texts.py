"""The text the benchmarks are cut from: Python's bundled documentation (`pydoc_data.topics`), in a
fixed order, so that every run and every system gets the same prompts."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve import LLM

QUESTION_TEMPLATES = (
    "In one sentence, what does the reference say about {}?",
    "Give a short Python example of {}.",
    "What is a common mistake with {}?",
)


def corpus() -> list[tuple[str, str]]:
    """(topic, text) pairs in a fixed order."""
    from pydoc_data.topics import topics

    return [(k, topics[k].strip()) for k in sorted(topics)]


def corpus_tokens(llm: LLM, n: int, seed: int) -> list[int]:
    """n token ids of whole topics, encoded by `llm`'s tokenizer: the topic at (i * 7919) % topics for
    i = seed, seed + 1, ... (a different seed, a different text), cut to n."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    ids: list[int] = []
    i = seed
    while len(ids) < n:
        ids += llm.tokenizer.encode(topics[keys[(i * 7919) % len(keys)]])
        i += 1
    return ids[:n]


def clip(tokenizer, text: str, num_tokens: int) -> str:
    """`text` cut to its first num_tokens tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def questions(rng: random.Random, n: int) -> list[str]:
    """n distinct short questions about documentation topics."""
    topics = [k.replace("-", " ") for k, _ in corpus()]
    pool = [t.format(k) for t in QUESTION_TEMPLATES for k in topics]
    return rng.sample(pool, n)
