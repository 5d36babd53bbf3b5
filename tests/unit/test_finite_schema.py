"""no_finite_document (issue 32.3): schemas that only infinite documents satisfy are found and
explained; a schema that some finite document satisfies is never refused (a property test builds
schemas together with a document that satisfies them)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.structured.finite import no_finite_document

ENDLESS = {
    "$defs": {"loop": {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}}, "required": ["x"]}}
}


@pytest.mark.parametrize(
    ("schema", "chain"),
    [
        (
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            "# -> #/$defs/a -> #/$defs/b -> #/$defs/a",
        ),
        ({"$ref": "#"}, "# -> #"),
        (
            {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
            "# -> #/properties/next -> #",
        ),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "# -> #/items -> #"),
        (
            {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2},
            "# -> #/prefixItems/1 -> #",
        ),
        ({"type": "array", "items": [{"$ref": "#"}], "minItems": 1}, "# -> #/items/0 -> #"),  # draft 7
        ({"type": "array", "contains": {"$ref": "#"}}, "# -> #/contains -> #"),
        ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, "# -> #/anyOf/0 -> #"),
        (
            {
                "type": ["object", "array"],
                "properties": {"a": {"$ref": "#"}},
                "required": ["a"],
                "items": {"$ref": "#"},
                "minItems": 1,
            },
            "# -> #/properties/a -> #",
        ),
        ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "# -> #/properties/x"),
    ],
)
def test_schemas_only_infinite_documents_satisfy_are_explained(schema: Any, chain: str) -> None:
    why = no_finite_document(schema)
    assert why is not None and why.startswith(chain + ":"), why


@pytest.mark.parametrize(
    "schema",
    [
        True,
        {},
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional: {} ends it
        {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # untyped: 1 satisfies it
        {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": "array", "contains": {"$ref": "#"}, "minContains": 0},
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        {"const": {"a": 1}, "$ref": "#"},  # a literal is finite (conflicts are llguidance's to report)
        {"$ref": "#/$defs/missing"},  # unresolved: llguidance's error, not ours
        {"$ref": "other.json#/a"},
        {"$defs": {"a": {"$id": "inner", "$ref": "#"}}, "$ref": "#/$defs/a"},  # a nested $id: no verdict
        {  # a ref into a nested $id: its "#" is that resource (read from the root, it would loop)
            "$defs": {
                "r": {"$id": "inner", "$defs": {"x": {"$ref": "#/$defs/ok"}, "ok": {"type": "string"}}},
                "ok": {"$ref": "#/$defs/r/$defs/x"},
            },
            "$ref": "#/$defs/r/$defs/x",
        },
    ],
)
def test_schemas_some_finite_document_satisfies_pass(schema: Any) -> None:
    assert no_finite_document(schema) is None


def test_a_long_reference_chain_resolves_in_few_passes() -> None:
    n = 150  # each $def needs the one before it; the first is a string
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i - 1}"}}, "required": ["x"]}
        for i in range(1, n)
    }
    defs["d0"] = {"type": "string"}
    assert no_finite_document({"$defs": defs, "$ref": f"#/$defs/d{n - 1}"}) is None
    defs["d0"] = {"$ref": f"#/$defs/d{n - 1}"}
    assert no_finite_document({"$defs": defs, "$ref": f"#/$defs/d{n - 1}"}) is not None


# --- property: a schema built with a finite document that satisfies it is never refused ------------
LEAVES = [
    ({"type": "string"}, "s"),
    ({"type": "integer"}, 3),
    ({"type": "null"}, None),
    ({"enum": [1, "a"]}, "a"),
]
LOOP = {"$ref": "#/$defs/loop"}  # ENDLESS's infinite subschema: branches that must never be chosen


def _extend(children: st.SearchStrategy[tuple[Any, Any]]) -> st.SearchStrategy[tuple[Any, Any]]:
    def obj(draw_props: list[tuple[str, tuple[Any, Any], bool]]) -> tuple[Any, Any]:
        props = {name: sub for name, (sub, _), _ in draw_props}
        props["loop"] = LOOP  # optional, so a document may leave it out
        required = [name for name, _, req in draw_props if req]
        return (
            {"type": "object", "properties": props, "required": required},
            {name: doc for name, (_, doc), req in draw_props if req},
        )

    prop = st.tuples(st.sampled_from(["a", "b", "c"]), children, st.booleans())
    objects = st.lists(prop, max_size=3, unique_by=lambda p: p[0]).map(obj)
    arrays = st.tuples(children, st.integers(0, 2)).map(
        lambda c: ({"type": "array", "items": c[0][0], "minItems": c[1]}, [c[0][1]] * c[1])
    )
    any_of = children.map(lambda c: ({"anyOf": [LOOP, c[0]]}, c[1]))
    all_of = children.map(lambda c: ({"allOf": [c[0]]}, c[1]))
    nullable = children.map(lambda c: ({"anyOf": [{"type": "null"}, c[0]]}, None))
    return objects | arrays | any_of | all_of | nullable


SCHEMAS = st.recursive(st.sampled_from(LEAVES), _extend, max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(SCHEMAS)
def test_a_schema_with_a_finite_document_is_never_refused(pair: tuple[Any, Any]) -> None:
    schema, document = pair
    schema = {**schema, "$defs": ENDLESS["$defs"]}
    jsonschema.validate(document, schema)  # the generator's claim
    assert no_finite_document(schema) is None


@settings(max_examples=100, deadline=None)
@given(SCHEMAS)
def test_requiring_the_root_inside_itself_is_always_refused(pair: tuple[Any, Any]) -> None:
    schema = {
        "allOf": [pair[0]],
        "type": "object",
        "properties": {"again": {"$ref": "#"}},
        "required": ["again"],
        "$defs": ENDLESS["$defs"],
    }
    assert no_finite_document(schema) is not None
