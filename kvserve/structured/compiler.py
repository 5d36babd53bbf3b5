"""GrammarCompiler: a StructuredOutput -> a compiled llguidance grammar, cached per (kind, schema)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import llguidance.hf
import torch

from kvserve.errors import InvalidRequestError
from kvserve.request import StructuredOutput
from kvserve.structured.matcher import GrammarMatcher, allowed_tokens
from kvserve.structured.schema import grammar_of

# (kind, schema text, param) -> llguidance grammar text; InvalidRequestError when the schema is bad
GrammarOf = Callable[[str, str | None, str], str]


def grammar_key(structured: StructuredOutput) -> tuple[str, str]:
    """What a compiled grammar is cached (and shared) under: equal keys compile to equal grammars."""
    return (structured.kind, structured.schema or "")


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer and hands out per-sequence matchers.

    `vocab_size` is the width of the model's logits (its lm_head rows), which may exceed the
    tokenizer's: masks are that wide and the rows past the tokenizer are never allowed.
    `eos_token_ids` are the tokens that end a sequence; the grammar allows them exactly when the
    document is complete. The llguidance tokenizer (about 0.3 s for a 49k vocabulary) is built by
    `prepare` (the server calls it at start-up) or else on first use, so engines that never see a
    structured request never pay for it.

    Compiled grammars are cached per grammar_key, the least recently used dropped past `max_cached`.
    Safe to call from several threads; a compile holds no lock, so a thread that finds its grammar
    cached never waits for another thread's compile (the server compiles on GrammarWorker's threads,
    the engine thread then makes matchers from the cache).
    """

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], max_cached: int = 128
    ):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached = max_cached
        self.num_compiles = 0  # grammars built (cache misses), for stats and tests
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache and num_compiles, held for dict operations only
        self._tokenizer_lock = threading.Lock()

    def prepare(self) -> None:
        """Build the llguidance tokenizer now, so that no request waits for it."""
        self._tokenizer()

    def check(self, structured: StructuredOutput, translate: GrammarOf = grammar_of) -> None:
        """Compile (or find cached) the grammar; InvalidRequestError naming the problem if it is invalid.
        `translate` makes the grammar's text from the schema (GrammarWorker passes its SchemaProcess's)."""
        self._compiled(structured, translate)

    def is_cached(self, structured: StructuredOutput) -> bool:
        with self._lock:
            return grammar_key(structured) in self._cache

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per sequence: n > 1 samples get n)."""
        template = self._compiled(structured)
        return GrammarMatcher(template.deep_copy(), self.eos_token_ids, structured.stop_on_repeated_item)

    def allowed_tokens(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: each row's allowed next tokens, filled in one call.
        Engine thread only."""
        return allowed_tokens(matchers, self.vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compiled(
        self, structured: StructuredOutput, translate: GrammarOf = grammar_of
    ) -> llguidance.LLMatcher:
        key = grammar_key(structured)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = self._compile(
            structured, translate
        )  # unlocked: up to seconds for a schema of thousands of keys
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = template
            self._cache.move_to_end(key)
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return template

    def _compile(self, structured: StructuredOutput, translate: GrammarOf) -> llguidance.LLMatcher:
        param = structured.source
        grammar = translate(structured.kind, structured.schema, param)
        template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"{param}: the JSON schema is invalid or unsupported: {template.get_error()}; "
                "fix the schema (JSON Schema draft 2020-12 keywords) and retry",
                param=param,
            )
        # the first mask builds the start's lexer states (50 ms for 2,000 optional properties): here,
        # not in an engine step, and copies of the template start from them
        template.compute_bitmask()
        if template.is_error() or (template.is_stopped() and not template.is_accepting()):
            reason = template.get_error().splitlines()[0] if template.is_error() else template.stop_reason()
            raise InvalidRequestError(
                f"{param}: the schema's grammar cannot start a document (llguidance: {reason}): no "
                "JSON document satisfies it, or it is too complex; fix the schema and retry",
                param=param,
            )
        return template

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer
