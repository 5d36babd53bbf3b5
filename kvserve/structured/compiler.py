"""GrammarCompiler: a StructuredOutput -> a compiled llguidance grammar, cached per (kind, schema)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf
import torch

from kvserve.errors import InvalidRequestError
from kvserve.request import StructuredOutput
from kvserve.structured.finite import no_finite_document
from kvserve.structured.matcher import GrammarMatcher, allowed_tokens

# JSON as models write it (json.dumps' separators) and nothing else between tokens: with flexible
# whitespace a small model can emit newlines forever inside an object and never finish it.
# Overrides, so a schema's "x-guidance" options cannot turn free whitespace back on.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT_SCHEMA = '{"type":"object"}'  # json_object: any JSON object

# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA_KEYS = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that lists `properties` but says nothing of
    `additionalProperties` closed (`"additionalProperties": false`), as xgrammar's strict mode and
    vLLM's guidance backend generate. Validation allows unlisted keys by default; generation that
    allows them lets a small model add keys of its own until max_tokens (langchain's bind_tools sends
    such schemas). A schema that wants extra keys says `"additionalProperties": true`. Branches of
    `allOf` are left open: each lists only part of the object's properties."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    if "allOf" in out and isinstance(out["allOf"], list):
        out["allOf"] = [_closed_inside(s) for s in out["allOf"]]
    if "properties" in out and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _closed_inside(schema: Any) -> Any:
    """An allOf branch: its own object stays open, the schemas inside it are closed."""
    if not isinstance(schema, dict):
        return schema
    had = "additionalProperties" in schema
    out = closed_objects(schema)
    if not had:
        out.pop("additionalProperties", None)
    return out


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

    def check(self, structured: StructuredOutput) -> None:
        """Compile (or find cached) the grammar; InvalidRequestError naming the problem if it is invalid."""
        self._compiled(structured)

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

    def _compiled(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        key = grammar_key(structured)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = self._compile(structured)  # unlocked: up to seconds for a schema of thousands of keys
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = template
            self._cache.move_to_end(key)
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return template

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        param = structured.source
        if structured.kind == "json_object":
            schema = ANY_OBJECT_SCHEMA
        elif structured.kind == "json_schema" and structured.schema is not None:
            schema = structured.schema
        else:
            raise InvalidRequestError(
                f"{param}: unknown structured output kind {structured.kind!r} (use json_object or "
                "json_schema with a schema)",
                param=param,
            )
        try:
            parsed = closed_objects(json.loads(schema))
            never_ends = no_finite_document(parsed)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(parsed, separators=(",", ":")),
                overrides=JSON_OPTIONS,  # type: ignore[arg-type]
            )
        except ValueError as e:
            raise InvalidRequestError(f"{param}: the JSON schema is invalid: {e}", param=param) from e
        except RecursionError as e:
            raise InvalidRequestError(
                f"{param}: the JSON schema nests too deeply to compile; flatten it with $defs", param=param
            ) from e
        if never_ends is not None:
            raise InvalidRequestError(
                f"{param}: no finite JSON document satisfies the schema: {never_ends}", param=param
            )
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
