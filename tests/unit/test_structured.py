"""kvserve.structured: masks, completion, the compile cache, invalid schemas; response_format parsing."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from kvserve.api.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.errors import InvalidRequestError
from kvserve.models.loader import resolve_model_path
from kvserve.request import StructuredOutput
from kvserve.structured import GrammarCompiler, GrammarMatcher, RepeatedItems
from kvserve.structured.schema import closed_objects

EOS = 2
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}


def schema_output(schema: dict, source: str = "response_format") -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")), source)


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-random-llama"))


@pytest.fixture(scope="module")
def compiler(hf) -> GrammarCompiler:
    return GrammarCompiler(hf, len(hf), [EOS])


def walk(compiler: GrammarCompiler, matcher: GrammarMatcher, hf, text: str) -> None:
    """Feed `text` token by token, checking each token is allowed by the mask before it."""
    for token in hf.encode(text, add_special_tokens=False):
        allowed = compiler.allowed_tokens([matcher])[0]
        assert allowed[token], f"{hf.decode([token])!r} not allowed in {text!r}"
        matcher.accept(token)


def test_mask_forces_the_schema_and_completion_ends_it(compiler, hf):
    matcher = compiler.matcher(schema_output(COLOR))
    allowed = compiler.allowed_tokens([matcher])[0]
    starts = {hf.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert starts and all(s.startswith("{") for s in starts)  # nothing but the object's start
    assert not allowed[EOS]
    walk(compiler, matcher, hf, '{"color": "re')
    allowed = compiler.allowed_tokens([matcher])[0]
    assert not allowed[hf.encode("blue", add_special_tokens=False)[0]] and not matcher.complete
    walk(compiler, matcher, hf, 'd"}')
    assert matcher.complete  # the object is closed: nothing but end-of-sequence may follow
    assert compiler.allowed_tokens([matcher])[0].nonzero().flatten().tolist() == [EOS]


def test_eos_is_allowed_exactly_when_the_document_is_complete_but_may_grow(compiler, hf):
    matcher = compiler.matcher(schema_output({"type": "integer"}))
    assert not compiler.allowed_tokens([matcher])[0][EOS]
    walk(compiler, matcher, hf, "7")
    allowed = compiler.allowed_tokens([matcher])[0]
    assert not matcher.complete  # 7 may become 70
    assert allowed[EOS] and allowed[hf.encode("0", add_special_tokens=False)[0]]
    matcher.accept(EOS)
    assert matcher.complete


def test_properties_come_in_the_schemas_order(compiler, hf):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    matcher = compiler.matcher(schema_output({**schema, "required": ["b", "a"]}))
    walk(compiler, matcher, hf, '{"')
    allowed = compiler.allowed_tokens([matcher])[0]
    assert allowed[hf.encode("b", add_special_tokens=False)[0]]
    assert not allowed[hf.encode("a", add_special_tokens=False)[0]]


def test_no_free_whitespace_between_tokens(compiler, hf):
    """A small model could otherwise emit newlines forever inside an object."""
    matcher = compiler.matcher(StructuredOutput("json_object"))
    walk(compiler, matcher, hf, '{"a": 1')
    allowed = compiler.allowed_tokens([matcher])[0]
    for text in ("\n", " ", "\t"):
        assert not allowed[hf.encode(text, add_special_tokens=False)[0]], repr(text)
    walk(compiler, matcher, hf, ', "b": [true, null]}')
    assert matcher.complete


def test_batched_masks_equal_one_by_one_and_cover_the_logits_width(hf):
    width = len(hf) + 64  # an lm_head with more rows than the tokenizer
    compiler = GrammarCompiler(hf, width, [EOS])
    a, b, c = (compiler.matcher(schema_output(COLOR)) for _ in range(3))
    walk(compiler, b, hf, '{"color": "')
    walk(compiler, c, hf, '{"color": "blue"}')
    batched = compiler.allowed_tokens([a, b, c])
    assert batched.shape == (3, width)
    for row, m in zip(batched, (a, b, c)):
        assert row.equal(compiler.allowed_tokens([m])[0])
    assert not batched[:, len(hf) :].any()
    assert not batched[0].equal(batched[1]) and not batched[1].equal(batched[2])


def test_objects_without_additional_properties_are_closed_for_generation():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "properties": point,  # a property named like the keyword is a schema, not a map
            "open": {**point, "additionalProperties": True},
            "list": {"type": "array", "items": point},
        },
        "$defs": {"p": point},
        "anyOf": [point],
        "allOf": [point, {"properties": {"y": {"type": "integer"}}}],
    }
    out = closed_objects(schema)
    closed = {**point, "additionalProperties": False}
    assert out["properties"]["properties"] == closed
    assert out["properties"]["open"]["additionalProperties"] is True  # said explicitly: kept
    assert out["properties"]["list"]["items"] == closed
    assert out["$defs"]["p"] == closed and out["anyOf"] == [closed]
    assert out["allOf"] == [point, {"properties": {"y": {"type": "integer"}}}]  # branches stay open
    assert "additionalProperties" not in out  # an object built with allOf stays open
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object
    assert schema["properties"]["properties"] == point  # the input is not changed


def test_generation_does_not_add_keys_the_schema_does_not_list(compiler, hf):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    matcher = compiler.matcher(schema_output(schema))
    walk(compiler, matcher, hf, '{"x": 1')
    allowed = compiler.allowed_tokens([matcher])[0]
    assert not allowed[hf.encode(",", add_special_tokens=False)[0]]  # no second key
    walk(compiler, matcher, hf, "}")
    assert matcher.complete


def test_repeated_items_are_noticed_as_the_text_grows():
    watch = RepeatedItems()
    text = ""
    seen = []
    for piece in [
        '[{"a": "}, {\\"x"}',
        ', {"b": [1, {"c": 2}]}',
        ', {"a": "}, {\\"x"',
        "}",
        ", [1]",
        ", [1]",
    ]:
        text += piece
        seen.append(watch.feed(text))
    # the escaped quote and the braces inside strings do not end an item; the third object repeats
    # the first only once its closing brace arrives; arrays are items too
    assert seen == [False, False, False, True, False, True]


def test_a_matcher_ends_at_a_repeated_item_only_when_asked(compiler, hf):
    schema = {"type": "array", "items": COLOR}
    text = '[{"color": "red"}, {"color": "red"}'
    for flag in (False, True):
        matcher = compiler.matcher(
            StructuredOutput("json_schema", json.dumps(schema), stop_on_repeated_item=flag)
        )
        walk(compiler, matcher, hf, text)
        assert matcher.ends(text) is flag and not matcher.complete


def test_a_rejected_token_raises(compiler, hf):
    matcher = compiler.matcher(schema_output(COLOR))
    with pytest.raises(RuntimeError, match="rejected token"):
        matcher.accept(hf.encode("hello", add_special_tokens=False)[0])


def test_grammars_are_compiled_once_per_schema_and_the_cache_is_bounded(hf):
    compiler = GrammarCompiler(hf, len(hf), [EOS], max_cached=2)
    one, two, three = (schema_output({"enum": [f"v{i}"]}) for i in range(3))
    compiler.check(one)
    m1, m2 = compiler.matcher(one), compiler.matcher(one)
    assert compiler.num_compiles == 1
    m1.accept(hf.encode('"', add_special_tokens=False)[0])  # matchers are independent copies
    assert not compiler.allowed_tokens([m2])[0].equal(compiler.allowed_tokens([m1])[0])
    compiler.check(two)
    compiler.check(StructuredOutput("json_object"))
    assert compiler.num_compiles == 3 and compiler.num_cached == 2  # `one` was dropped
    compiler.check(StructuredOutput("json_object"))
    assert compiler.num_compiles == 3
    compiler.check(one)
    compiler.check(three)
    assert compiler.num_compiles == 5 and compiler.num_cached == 2


@pytest.mark.parametrize(
    ("schema", "detail"),
    [
        ('{"type":"wat"}', "wat"),
        ('{"properties":{"a":{"$ref":"#/$defs/missing"}},"type":"object"}', "missing"),
        ('{"minLength":5,"maxLength":2,"type":"string"}', ""),
        ("[1, 2]", ""),
        (
            '{"type":"array","items":' * 1500 + '{"type":"string"}' + "}" * 1500,
            "nests too deeply",
        ),  # was a 500
    ],
)
def test_invalid_schemas_are_400s_naming_the_parameter_and_the_problem(compiler, schema, detail):
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(StructuredOutput("json_schema", schema, source="tools"))
    assert err.value.param == "tools"
    assert "schema" in str(err.value) and detail in str(err.value)


@pytest.mark.parametrize(
    ("schema", "detail"),
    [
        (  # issue 32.3: was a 200 with content "" and finish reason stop
            '{"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"}',
            "no finite JSON document satisfies the schema: # -> #/$defs/a -> #/$defs/b -> #/$defs/a",
        ),
        (  # issue 32.3: ran to max_tokens
            '{"type":"object","properties":{"next":{"$ref":"#"}},"required":["next"]}',
            "no finite JSON document satisfies the schema: # -> #/properties/next -> #",
        ),
        (  # a cycle the analysis leaves alone (a nested $id): llguidance's grammar cannot start
            '{"$defs":{"a":{"$id":"http://x/inner","$ref":"#"}},"$ref":"#/$defs/a"}',
            "grammar cannot start a document",
        ),
    ],
)
def test_schemas_no_finite_document_satisfies_are_400s_that_say_why(compiler, schema, detail):
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(StructuredOutput("json_schema", schema))
    assert err.value.param == "response_format" and detail in str(err.value)
    assert not compiler.is_cached(StructuredOutput("json_schema", schema))


# --- response_format -------------------------------------------------------------------------------
def chat(response_format: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    )


def test_response_format_becomes_a_canonical_structured_output():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "thing_1", "schema": schema, "strict": True}}
    structured = chat(rf).to_sampling_params(100).structured
    assert structured == StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))
    assert json.loads(structured.schema) == schema
    assert structured.schema.index('"b"') < structured.schema.index('"a"')  # the schema's order is kept
    assert chat({"type": "json_object"}).to_sampling_params(100).structured == StructuredOutput("json_object")
    assert chat({"type": "text"}).to_sampling_params(100).structured is None
    no_schema = {"type": "json_schema", "json_schema": {"name": "any"}}
    assert chat(no_schema).to_sampling_params(100).structured == StructuredOutput("json_object")
    completion = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert completion.to_sampling_params().structured == StructuredOutput("json_object")


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema"},  # no json_schema
        {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},  # json_schema with another type
    ],
)
def test_inconsistent_response_formats_are_400s(response_format):
    with pytest.raises(InvalidRequestError) as err:
        chat(response_format).to_sampling_params(100)
    assert err.value.param == "response_format"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "x" * 65}},
        {"type": "json_schema", "json_schema": {"schema": {}}},  # name is required
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},  # a string, not an object
        {"type": "json_object", "extra": 1},
    ],
)
def test_malformed_response_formats_fail_validation(response_format):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        chat(response_format)
