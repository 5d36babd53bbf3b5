"""no_finite_document: why no finite JSON document satisfies a JSON schema, or None.

A schema whose every instance must contain another instance of itself (a `$ref` cycle with no other
branch, a recursive property that is required, a recursive array item with minItems >= 1) has only
infinite instances, and llguidance compiles it anyway: a pure `$ref` cycle stops at once (the reply
was an empty 200) and a required recursion forces `{"next": {"next": ...` until max_tokens.

The analysis is the least fixed point of "has a finite instance" over the schema's subschemas. Each
rule is necessary for a finite instance to exist, never sufficient (conflicting keywords are
llguidance's to report), so a schema is only refused when it really has no finite instance:

  false                   none
  true, const, enum       one (a literal is finite)
  $ref                    the target has one
  allOf                   every branch has one
  anyOf, oneOf            some branch has one (an empty list is llguidance's error)
  type t (or any type)    object: each required property listed in `properties` has one
                          array: the first minItems positional items, the rest by `items`,
                                 and `contains` (unless minContains is 0)
                          anything else: one

Keywords not listed (not, if/then/else, patternProperties, dependentSchemas, ...) are assumed
satisfiable. Only "#"-rooted JSON pointers are followed; a schema with `$id` below its root (a new
base for its refs) or nesting deeper than Python's recursion limit gets no verdict (None).
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def no_finite_document(schema: Any) -> str | None:
    """None when some finite JSON document may satisfy `schema` (parsed JSON); otherwise why not:
    the chain of subschemas (JSON pointers) each of which needs the next, ending where it loops
    back or at a subschema nothing satisfies."""
    try:
        analysis = _Finite(schema)
        return None if analysis.solve() else analysis.explain()
    except (_NoVerdict, RecursionError):
        return None


class _NoVerdict(Exception):
    """The analysis met what it does not follow: a `$id` below the root (refs inside it resolve
    against it, not against the root)."""


class _Finite:
    """The fixed point, as for a grammar's productive nonterminals: the root ("#") and every `$ref`
    target are evaluated with the refs they read taken from `finite` (a target not known finite
    counts as infinite for now); when one turns out finite, those that read it are evaluated again.
    Each target is evaluated once plus once per target it reads that turns finite; recursion goes as
    deep as the schema nests, not as long as a chain of refs."""

    def __init__(self, root: Any):
        self.root = root
        self.finite: set[str] = set()  # pointers of the root and $ref targets with a finite instance
        self._readers: dict[str, set[str]] = {}  # target -> the pointers whose evaluation read it
        self._evaluating: str | None = None  # the pointer being evaluated; None: the fixed point is reached
        self._found: list[str] = []  # targets read for the first time, to evaluate

    def solve(self) -> bool:
        work = deque(["#"])
        seen = {"#"}
        while work:
            pointer = work.popleft()
            self._evaluating = pointer
            if pointer not in self.finite and self.ok(self._target(pointer)[1]):
                self.finite.add(pointer)
                work.extend(self._readers.get(pointer, ()))
            for target in self._found:
                if target not in seen:
                    seen.add(target)
                    work.append(target)
            self._found.clear()
        self._evaluating = None
        return "#" in self.finite

    def ok(self, node: Any) -> bool:
        """Whether `node` may have a finite instance, by the rules in the module docstring."""
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: llguidance reports it
        return not self.needs(node)

    def needs(self, node: dict[str, Any]) -> list[tuple[str, Any]]:
        """The (pointer suffix, subschema) pairs that `node` needs and that have no finite instance
        (empty: `node` may have one); of a disjunction none of whose branches has one, its first."""
        if "$id" in node and node is not self.root:
            raise _NoVerdict
        if "const" in node or "enum" in node:
            return []
        needed: list[tuple[str, Any]] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and not self._ref_ok(ref):
            needed.append(("$ref", self._target(ref)[1]))
        branches = node.get("allOf")
        if isinstance(branches, list):
            needed += [(f"allOf/{i}", b) for i, b in enumerate(branches) if not self.ok(b)]
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(self.ok(b) for b in branches):
                needed.append((f"{key}/0", branches[0]))
        types = node.get("type", _TYPES)
        types = [types] if isinstance(types, str) else types
        per_type = [self._type_needs(node, t) for t in types if isinstance(t, str)]
        if per_type and all(per_type):
            needed += per_type[0]
        return needed

    def _type_needs(self, node: dict[str, Any], type_: str) -> list[tuple[str, Any]]:
        """What an instance of `node` of JSON type `type_` needs that has no finite instance."""
        if type_ == "object":
            props, required = node.get("properties"), node.get("required")
            if not isinstance(props, dict) or not isinstance(required, list):
                return []
            return [
                (f"properties/{_escape(n)}", props[n])
                for n in required
                if isinstance(n, str) and n in props and not self.ok(props[n])
            ]
        if type_ != "array":
            return []
        prefix_key, rest_key = "prefixItems", "items"
        if isinstance(node.get("items"), list):  # draft 4-7 tuples: items is the prefix
            prefix_key, rest_key = "items", "additionalItems"
        prefix, rest = node.get(prefix_key), node.get(rest_key)
        prefix = prefix if isinstance(prefix, list) else []
        min_items = node.get("minItems", 0)
        min_items = min_items if isinstance(min_items, int) else 0
        needed = [(f"{prefix_key}/{i}", s) for i, s in enumerate(prefix[:min_items]) if not self.ok(s)]
        if min_items > len(prefix) and rest is not None and not self.ok(rest):
            needed.append((rest_key, rest))
        contains, min_contains = node.get("contains"), node.get("minContains", 1)
        if contains is not None and min_contains != 0 and not self.ok(contains):
            needed.append(("contains", contains))
        return needed

    def _ref_ok(self, ref: str) -> bool:
        pointer = self._target(ref)[0]
        if pointer is None or pointer in self.finite:
            return True  # unresolved: llguidance reports it
        if self._evaluating is not None:
            self._readers.setdefault(pointer, set()).add(self._evaluating)
            self._found.append(pointer)
        return False

    def _target(self, ref: str) -> tuple[str | None, Any]:
        if ref == "#":
            return "#", self.root
        if not ref.startswith("#/"):
            return None, None
        node = self.root
        for part in ref[2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and "$id" in node and node is not self.root:
                raise _NoVerdict
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None, None
        return ref, node

    def explain(self) -> str:
        """The chain from the root through subschemas without a finite instance (at the fixed point)."""
        chain: list[str] = []
        pointer, node = "#", self.root
        while pointer not in chain:
            chain.append(pointer)
            if isinstance(node, bool) or not isinstance(node, dict):
                return " -> ".join(chain) + ": each needs the next, and the last allows no value"
            key, child = self.needs(node)[0]
            if key == "$ref":
                pointer = self._target(node["$ref"])[0] or pointer
            else:
                pointer = f"{pointer}/{key}" if pointer != "#" else f"#/{key}"
            node = child
        return " -> ".join([*chain, pointer]) + (
            ": each needs the next, so a document would never end; give the recursion a way out (make "
            "a property on the way optional, add an anyOf branch without it, or allow an empty array)"
        )


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
