"""Structured outputs over HTTP with the real OpenAI SDK against SmolLM2: the SDK's parse helper,
streamed json_schema, json_object on both endpoints, n > 1, the 400 that names an invalid schema,
and the target: schema-valid JSON in 50 of 50 json_schema requests, streamed and not.

VALIDITY_CASES and run_validity are also what scripts/bench_structured.py --suite validity runs."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import Server

MODEL = "smollm2-135m"


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    population_millions: int = Field(ge=0, le=100)


def test_sdk_parse_returns_the_pydantic_model(smollm2_server: Server) -> None:
    completion = smollm2_server.client().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris, the capital of France, as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City)
    assert city.continent == "Europe" and "Paris" in city.name  # the model's answer, held to the schema


def test_streamed_json_schema_equals_the_unstreamed_answer(smollm2_server: Server) -> None:
    schema = VALIDITY_CASES[0][1]
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a user profile."}],
        response_format={"type": "json_schema", "json_schema": {"name": "profile", "schema": schema}},
        temperature=0,
        max_tokens=150,
    )
    client = smollm2_server.client()
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really streamed
    assert text == whole.choices[0].message.content and finish == ["stop"]
    jsonschema.validate(json.loads(text), schema)


def test_json_object_on_chat_and_completions_with_n(smollm2_server: Server) -> None:
    client = smollm2_server.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=3,
        n=2,
        max_tokens=200,
    )
    completion = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a book:",
        extra_body={"response_format": {"type": "json_object"}},
        temperature=0,
        max_tokens=200,
    )
    texts = [c.message.content or "" for c in chat.choices] + [completion.choices[0].text]
    reasons = [c.finish_reason for c in chat.choices] + [completion.choices[0].finish_reason]
    assert reasons == ["stop"] * 3, texts
    assert all(isinstance(json.loads(t), dict) for t in texts)


def test_an_invalid_schema_is_a_400_that_names_it(smollm2_server: Server) -> None:
    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
            max_tokens=20,  # the default (the rest of the context) needs more KV than this pool: a 400 too
        )
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == "response_format"
    assert "schema" in body["message"] and "integr" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # OpenAI's name pattern
        smollm2_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "no spaces allowed"}},
        )
    assert "name" in str(err.value)


# --- the target: 50 json_schema requests, all schema-valid ------------------------------------------
def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_SHORT = {"type": "string", "maxLength": 40}
# (prompt, schema): ten schemas (flat, nested objects, enums, arrays, numbers, booleans), five prompts each
_SCHEMA_PROMPTS: list[tuple[dict[str, Any], list[str]]] = [
    (
        _obj(
            {
                "username": _SHORT,
                "age": {"type": "integer", "minimum": 13, "maximum": 120},
                "active": {"type": "boolean"},
            }
        ),
        [
            "Invent a user profile.",
            "Create a profile for a teenage gamer.",
            "Profile of a retired teacher.",
            "A user who likes hiking.",
            "Make up an account for a chef.",
        ],
    ),
    (
        _obj(
            {
                "title": _SHORT,
                "genre": {"enum": ["fiction", "mystery", "science", "history", "poetry"]},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            }
        ),
        [
            "Recommend a book.",
            "A classic mystery novel.",
            "A book about space.",
            "An old poetry collection.",
            "A history book about Rome.",
        ],
    ),
    (
        _obj(
            {
                "city": _SHORT,
                "location": _obj(
                    {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    }
                ),
            }
        ),
        [
            "Where is Tokyo?",
            "Give the coordinates of London.",
            "Locate Cairo.",
            "Where is Sydney?",
            "Coordinates of New York.",
        ],
    ),
    (
        _obj(
            {
                "ingredients": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 5},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
            }
        ),
        [
            "A pancake recipe.",
            "How to make tea.",
            "A simple salad.",
            "Cook pasta with tomato sauce.",
            "Bake bread.",
        ],
    ),
    (
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        [
            "Classify: 'I love this phone!'",
            "Classify: 'The service was terrible.'",
            "Classify: 'It arrived on Tuesday.'",
            "Classify: 'Best day ever.'",
            "Classify: 'I want a refund.'",
        ],
    ),
    (
        _obj(
            {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": _obj(
                        {"product": _SHORT, "quantity": {"type": "integer", "minimum": 1, "maximum": 20}}
                    ),
                },
                "status": {"enum": ["pending", "shipped", "delivered"]},
            }
        ),
        [
            "An order of two apples.",
            "A shipped order of a laptop.",
            "A delivered order of books and pens.",
            "A pending order.",
            "An order of five shirts.",
        ],
    ),
    (
        _obj(
            {
                "person": _obj(
                    {
                        "first": {"type": "string", "maxLength": 20},
                        "last": {"type": "string", "maxLength": 20},
                    }
                ),
                "email": _SHORT,
                "tags": {"type": "array", "items": {"enum": ["vip", "new", "churned"]}, "maxItems": 2},
            }
        ),
        [
            "A new customer record.",
            "A VIP client.",
            "A customer who left.",
            "Record for Jane Doe.",
            "Record for John Smith.",
        ],
    ),
    (
        _obj({"answer": {"type": "integer", "minimum": -1000, "maximum": 1000}, "explanation": _SHORT}),
        [
            "What is 7 times 8?",
            "What is 100 minus 42?",
            "What is 12 plus 30?",
            "What is 9 squared?",
            "What is 81 divided by 9?",
        ],
    ),
    (
        _obj(
            {
                "event": _SHORT,
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "online": {"type": "boolean"},
            }
        ),
        [
            "A birthday party.",
            "A team meeting.",
            "A concert next summer.",
            "A webinar on Python.",
            "A wedding.",
        ],
    ),
    (
        _obj(
            {
                "planet": {
                    "enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
                },
                "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                "facts": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 2},
            }
        ),
        [
            "Tell me about Mars.",
            "Facts about Jupiter.",
            "Describe Earth.",
            "Something about Saturn.",
            "Describe Venus.",
        ],
    ),
]
VALIDITY_CASES: list[tuple[str, dict[str, Any]]] = [
    (prompt, schema) for schema, prompts in _SCHEMA_PROMPTS for prompt in prompts
]
VALIDITY_MAX_TOKENS = 200


def _one(client: openai.OpenAI, index: int, prompt: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Request `index`: even ones streamed; every third one sampled (seeded), the others greedy."""
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"case_{index}", "schema": schema}},
        max_tokens=VALIDITY_MAX_TOKENS,
        temperature=0.7 if index % 3 == 0 else 0.0,
        seed=index,
    )
    if index % 2 == 0:
        chunks = list(client.chat.completions.create(**request, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(
            c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason
        )
    else:
        choice = client.chat.completions.create(**request).choices[0]
        text, finish = choice.message.content or "", choice.finish_reason
    try:
        jsonschema.validate(json.loads(text), schema)
        error = None
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"index": index, "streamed": index % 2 == 0, "finish_reason": finish, "text": text, "error": error}


def run_validity(client: openai.OpenAI, concurrency: int = 8) -> list[dict[str, Any]]:
    """Every VALIDITY_CASES request, `concurrency` at a time; one result per request, in order."""
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(_one, client, i, p, s) for i, (p, s) in enumerate(VALIDITY_CASES)]
        return [f.result() for f in futures]


def test_fifty_json_schema_requests_are_all_schema_valid(smollm2_server: Server) -> None:
    assert len(VALIDITY_CASES) == 50
    results = run_validity(smollm2_server.client())
    invalid = [r for r in results if r["error"] is not None]
    assert not invalid, invalid
    assert all(r["finish_reason"] == "stop" for r in results)
    assert sum(r["streamed"] for r in results) == 25
