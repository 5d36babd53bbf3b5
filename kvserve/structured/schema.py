"""A structured output's schema -> its llguidance grammar (text), and a process that makes it.

Everything here is Python over the schema (parse, close the objects, look for documents that never
end, llguidance's schema-to-grammar translation): about 30 ms of held GIL for a 418 KB schema, in
pieces of 5-14 ms. On the server that work runs in SchemaProcess, a process of its own, so a burst
of large schemas does not take the GIL from the engine thread and the event loop (measured: the
longest gap of a running stream while five such schemas compile, docs/server.md). The grammar's
compilation against the tokenizer (llguidance.LLMatcher, which drops the GIL) stays in the server.

This module imports no torch: SchemaProcess's child starts in well under a second.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import llguidance

from kvserve.errors import InvalidRequestError
from kvserve.structured.finite import no_finite_document

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


def grammar_of(kind: str, schema: str | None, param: str) -> str:
    """The llguidance grammar of a structured output: `kind` json_object (any object) or json_schema
    with `schema` (its JSON text). InvalidRequestError naming `param` when the schema is invalid,
    nests too deeply, or no finite document satisfies it."""
    if kind == "json_object":
        schema = ANY_OBJECT_SCHEMA
    elif kind != "json_schema" or schema is None:
        raise InvalidRequestError(
            f"{param}: unknown structured output kind {kind!r} (use json_object or json_schema with a schema)",
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
    return str(grammar)


class SchemaProcess:
    """grammar_of in a child process (`python -m kvserve.structured.schema`), one call at a time,
    over a socket pair (multiprocessing's Connection: pickled messages). Started at construction, so
    no request waits for its start. A child that died (killed, out of memory) is replaced, and that
    call is answered in this process: a request never fails because the child did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start()

    def grammar_of(self, kind: str, schema: str | None, param: str) -> str:
        with self._lock:
            try:
                self._conn.send((kind, schema, param))
                ok, text = self._conn.recv()
            except (EOFError, OSError):
                self._stop()
                self._start()
                return grammar_of(kind, schema, param)
        if not ok:
            raise InvalidRequestError(text, param=param)
        return str(text)

    def close(self) -> None:
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.structured.schema", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        self._conn = Connection(ours.detach())

    def _stop(self) -> None:
        self._conn.close()  # the child reads EOF and exits
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _serve(fd: int) -> None:
    """The child: answer (kind, schema, param) with (True, grammar) or (False, the 400's message)
    until the server closes its end."""
    conn = Connection(fd)
    while True:
        try:
            kind, schema, param = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, grammar_of(kind, schema, param)))
        except InvalidRequestError as e:
            conn.send((False, e.message))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
