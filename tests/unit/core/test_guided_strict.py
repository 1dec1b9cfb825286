"""Object schemas are closed unless they allow more (core.guided.strict_schema): what the
rewrite does to a schema, and what llguidance then accepts on the demo model's tokenizer."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from core.guided import JSON_DEFAULTS, llguidance_grammar, strict_schema
from core.types import Guide

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_object_schemas_with_properties_are_closed_everywhere():
    schema = {
        "type": "object",
        "properties": {
            "pet": PERSON,
            "tags": {"type": "array", "items": PERSON},
            "properties": {"type": "string"},  # a property named like the keyword
        },
        "$defs": {"p": PERSON},
        "anyOf": [PERSON, {"type": "string"}],
    }
    out = json.loads(strict_schema(json.dumps(schema)))
    assert out["additionalProperties"] is False
    assert out["properties"]["pet"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["properties"] == {"type": "string"}
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False and out["anyOf"][1] == {"type": "string"}


@pytest.mark.parametrize(
    "schema",
    [
        {**PERSON, "additionalProperties": True},
        {**PERSON, "additionalProperties": {"type": "integer"}},
        {**PERSON, "unevaluatedProperties": False},
        {"type": "object"},  # declares nothing: left as it is
    ],
)
def test_schemas_that_say_what_else_is_allowed_are_left_alone(schema):
    assert json.loads(strict_schema(json.dumps(schema))) == schema


@pytest.mark.parametrize("text", ["true", "[1]", "{nope"])
def test_text_that_is_not_an_object_schema_is_returned_as_is(text):
    assert strict_schema(text) == text


def accepts(tokenizer, schema: dict, text: str) -> bool:
    ll = llguidance.hf.from_tokenizer(tokenizer.hf)
    grammar = llguidance_grammar(Guide("json_schema", json.dumps(schema)))
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


def test_llguidance_refuses_undeclared_properties_unless_allowed(bpe_tokenizer):
    assert JSON_DEFAULTS["key_separator"] == ": "
    assert accepts(bpe_tokenizer, PERSON, '{"name": "Ada"}')
    assert not accepts(bpe_tokenizer, PERSON, '{"name": "Ada", "age": 3}')
    assert accepts(bpe_tokenizer, {**PERSON, "additionalProperties": True}, '{"name": "Ada", "age": 3}')
