"""Structured output (guided decoding) in the core: checking a request's guide once, for every
engine, and the guide's text in each grammar library's terms.

A guide is checked in two stages, both before the request reaches an engine (so a bad one fails
with INVALID_ARGUMENT before the first message):
  * `check_guide` (from core.validation): the shape rules of trellis.generate.v1.GuidedDecoding
    (one guide set, a schema that is JSON, a non-empty choice list, sizes) and whether the
    engine honours the kind (EngineInfo.guided_decoding);
  * `check_compiles` (from the request pipeline): the schema, regex or grammar compiles with
    llguidance (the HF engine's grammar library; guidance-ai/llguidance, also a TensorRT-LLM
    backend). Results are cached per guide (bounded), so a repeated schema costs a dict lookup.

`llguidance_grammar` is the one translation of a Guide into llguidance's grammar text (used by
the check and by the HF engine's matchers, core.engine.hf_guided); `ebnf_choice` writes a
choice list as the EBNF TensorRT-LLM's XGrammar backend takes.

Object schemas are closed by default: an object schema with `properties` and neither
`additionalProperties` nor `unevaluatedProperties` gets `"additionalProperties": false`
(`strict_schema`), so the output has only the properties the schema declares, as XGrammar's
strict mode (TensorRT-LLM's backend, and vLLM's default) has it; a schema that allows more says
so with `"additionalProperties": true` (or a schema for them).

JSON output is compact by default: `", "` and `": "` separators and no other whitespace, as
Python's json.dumps writes it. Free whitespace lets a model pad a JSON value without end (an
untrained model does); a schema may still ask for it with llguidance's
`"x-guidance": {"whitespace_flexible": true}`.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from core.errors import InvalidArgument
from core.types import GUIDE_KINDS, Guide

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: Largest schema, regex or grammar text accepted, in characters (a guide this large takes
#: seconds to compile and is far beyond what structured output needs).
MAX_GUIDE_CHARS = 256 * 1024
#: Most alternatives of a choice guide.
MAX_CHOICES = 1024
#: Compile results kept (`check_compiles`); the HF engine keeps its own matchers likewise.
CACHE_SIZE = 512

#: llguidance's JSON compile options applied unless the schema's "x-guidance" overrides them.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_guide(guide: Guide, supported: frozenset[str], engine: str) -> None:
    """Check a guide's shape and that the engine honours its kind.

    Args:
        guide: the request's guide.
        supported: the kinds the engine honours (EngineInfo.guided_decoding).
        engine: the engine's kind, for the message.

    Raises:
        InvalidArgument: naming "guided_decoding" (no guide set) or the guide's own field
            ("guided_decoding.json_schema", ...).
    """
    if guide.kind not in GUIDE_KINDS:
        raise InvalidArgument(
            "guided_decoding sets no guide; set one of " + ", ".join(GUIDE_KINDS) + " (json_object must be true).",
            field="guided_decoding",
        )
    if guide.kind not in supported:
        offered = ", ".join(k for k in GUIDE_KINDS if k in supported) or "none"
        raise InvalidArgument(
            f"The {engine} engine does not support guided decoding by {guide.kind}; it supports: {offered}.",
            field=guide.field,
        )
    if len(guide.spec) > MAX_GUIDE_CHARS:
        raise InvalidArgument(
            f"{guide.kind} is {len(guide.spec)} characters long; at most {MAX_GUIDE_CHARS} are accepted.",
            field=guide.field,
        )
    if guide.kind == "json_schema":
        _check_schema_text(guide.spec, guide.field)
    elif guide.kind == "choice":
        if not guide.choices:
            raise InvalidArgument("choice needs at least one alternative.", field=guide.field)
        if len(guide.choices) > MAX_CHOICES:
            raise InvalidArgument(
                f"choice has {len(guide.choices)} alternatives; at most {MAX_CHOICES} are accepted.", field=guide.field
            )
        if not all(guide.choices):
            raise InvalidArgument("choice alternatives must not be empty strings.", field=guide.field)
        if sum(map(len, guide.choices)) > MAX_GUIDE_CHARS:
            raise InvalidArgument(f"choice alternatives exceed {MAX_GUIDE_CHARS} characters.", field=guide.field)
    elif guide.kind != "json_object" and not guide.spec.strip():
        raise InvalidArgument(f"{guide.kind} must not be empty.", field=guide.field)


def _check_schema_text(text: str, field: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"json_schema is not valid JSON: {e}.", field=field) from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument("json_schema must be a JSON object (or a boolean schema).", field=field)


def check_compiles(guide: Guide) -> None:
    """Check that a guide (already through `check_guide`) compiles with llguidance.

    Raises:
        InvalidArgument: naming the guide's field, with llguidance's message (e.g. "Invalid
            type: objectx", "unclosed character class").
    """
    error = _compile_error(guide)
    if error:
        raise InvalidArgument(f"The {guide.kind} does not compile: {error}", field=guide.field)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile_error(guide: Guide) -> str:
    """llguidance's error for a guide ("" when it compiles), cached per guide."""
    from llguidance import LLMatcher

    try:
        grammar = llguidance_grammar(guide)
    except ValueError as e:  # a GBNF grammar that does not convert to Lark
        return str(e)
    return LLMatcher.validate_grammar(grammar).strip()


def llguidance_grammar(guide: Guide) -> str:
    """The guide as llguidance grammar text (what `llguidance.LLMatcher` takes).

    json_object is the schema {"type": "object"}; choice is a Lark alternation of the JSON-quoted
    strings (llguidance's own "choice" format); ebnf_grammar goes through llguidance's GBNF to Lark
    converter.

    Raises:
        ValueError: an EBNF grammar the converter cannot read, or an unknown kind.
    """
    from llguidance import LLMatcher, grammar_from

    if guide.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if guide.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(strict_schema(guide.spec), defaults=JSON_DEFAULTS)
    if guide.kind == "regex":
        return LLMatcher.grammar_from_regex(guide.spec)
    if guide.kind == "ebnf_grammar":
        return grammar_from("gbnf", guide.spec)
    if guide.kind == "lark_grammar":
        return LLMatcher.grammar_from_lark(guide.spec)
    if guide.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in guide.choices))
    raise ValueError(f"unknown guide kind {guide.kind!r}")


#: JSON Schema keywords whose value is a schema, a list of schemas, or a map of name -> schema
#: (JSON Schema 2020-12 "Core" and "Applicator" vocabularies, with draft-07's definitions,
#: additionalItems and dependencies).
_SCHEMA_KEYWORDS = frozenset(
    {
        "items",
        "additionalItems",
        "unevaluatedItems",
        "contains",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
_SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMA_MAP_KEYWORDS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def strict_schema(text: str) -> str:
    """A JSON Schema's text with every object schema that declares `properties` closed:
    `"additionalProperties": false` where neither it nor `unevaluatedProperties` is given (the
    default of XGrammar's strict mode, `xgrammar.Grammar.from_json_schema(strict_mode=True)`).
    Text that is not a JSON object is returned as it is (check_guide refuses it first)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    if not isinstance(schema, dict):
        return text
    return json.dumps(_closed(schema))


def _closed(node: object) -> object:
    """A schema node with its object schemas closed (see `strict_schema`); a new value."""
    if not isinstance(node, dict):
        return node
    out: dict[str, object] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out[key] = [_closed(sub) for sub in value]
        elif key in _SCHEMA_KEYWORDS:
            out[key] = _closed(value)
        else:
            out[key] = value
    if "properties" in node and "additionalProperties" not in node and "unevaluatedProperties" not in node:
        out["additionalProperties"] = False
    return out


def ebnf_choice(choices: tuple[str, ...]) -> str:
    """A choice list as an EBNF grammar in XGrammar's dialect: `root ::= "a" | "b"` with each
    string JSON-quoted (XGrammar's EBNF string literals take the same escapes; vLLM's xgrammar
    backend writes choices the same way)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
