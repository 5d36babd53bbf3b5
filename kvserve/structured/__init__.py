"""Grammar-constrained decoding (structured outputs) through llguidance.

  GrammarCompiler  built once per engine from its tokenizer; compiles a StructuredOutput into a
                   grammar (cached per (kind, schema), bounded LRU) and hands out per-sequence matchers;
                   refuses a schema no finite document satisfies (finite.no_finite_document)
  GrammarWorker    the server's compiles, on threads of their own (shortest schema first, bounded),
                   each with a SchemaProcess for the schema's Python work (schema.py): a large
                   schema stalls neither the event loop nor the engine thread
  GrammarMatcher   one sequence's position in its grammar: accept a token, complete or not
  allowed_tokens   the next-token masks of a step's constrained rows, filled in one batched call

Why llguidance and not xgrammar: measured on this CPU with the SmolLM2 tokenizer
(scripts/bench_structured.py --suite libraries, docs/server.md "Structured outputs"), it fills a
mask about 3.5x faster and compiles a schema in under a millisecond where xgrammar 0.2.8 takes
50-180 ms. A step's masks go into one bitmask in one call (allowed_tokens says why serially).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.items import ArrayItems, RepeatedItems
    from kvserve.structured.matcher import GrammarMatcher, allowed_tokens
    from kvserve.structured.worker import GrammarWorker

__all__ = [
    "ArrayItems",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarWorker",
    "RepeatedItems",
    "allowed_tokens",
]

_HOMES = {
    "ArrayItems": "items",
    "GrammarCompiler": "compiler",
    "GrammarMatcher": "matcher",
    "GrammarWorker": "worker",
    "RepeatedItems": "items",
    "allowed_tokens": "matcher",
}


def __getattr__(name: str) -> Any:
    """The names above, imported on first use: SchemaProcess's child imports kvserve.structured.schema
    alone, without torch."""
    if name not in _HOMES:
        raise AttributeError(f"module 'kvserve.structured' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvserve.structured.{_HOMES[name]}"), name)
