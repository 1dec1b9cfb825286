"""Structured-output parameters of the public schemas -> the contract's GuidedDecoding, as pure
functions shared by the gateways.

  * OpenAI `response_format` (chat completions, and any other OpenAI route that takes it):
    `{"type": "text"}` (no guide), `{"type": "json_object"}`, `{"type": "json_schema",
    "json_schema": {"name", "description"?, "schema"?, "strict"?}}` (OpenAI's API reference,
    "Structured Outputs"); `ResponseFormat` checks the shape, `response_format_guide` maps it.
  * TGI's `grammar` (LMI `parameters.grammar`): `{"type": "json", "value": <JSON Schema, an
    object or its text>}` ("json_object" is the same), `{"type": "json_schema", "value":
    {"name"?, "schema"}}` or `{"type": "regex", "value": "<regex>"}` (text-generation-inference
    router/src/lib.rs `GrammarType`, 3.x).
  * vLLM's request extras, which the Triton gateway takes as parameters: `guided_json` (a schema
    object or text), `guided_regex`, `guided_choice` (a list of strings), `guided_grammar` (EBNF
    text), at most one of them (vLLM's `GuidedDecodingParams`); and TensorRT-LLM's ensemble inputs
    `guided_decoding_guide_type` ("json", "json_schema", "regex", "ebnf_grammar") with
    `guided_decoding_guide` (tensorrtllm_backend docs/guided_decoding.md).

Only shapes are checked here; whether a schema or grammar compiles, and whether the engine
supports the kind, is the core's answer (INVALID_ARGUMENT naming "guided_decoding.<kind>", which
each gateway's field table names back in the client's terms).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common.schema import json_type
from gateways.common.status import GatewayError

#: OpenAI's rule for `json_schema.name` (and function names).
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ResponseFormatText(_Wire):
    """`{"type": "text"}`: free text (the default)."""

    type: Literal["text"]


class ResponseFormatJsonObject(_Wire):
    """`{"type": "json_object"}`: any JSON object ("JSON mode")."""

    type: Literal["json_object"]


class JsonSchemaFormat(_Wire):
    """`json_schema` of a json_schema response format. `strict` is accepted: the output always
    follows the schema here. A missing schema means any JSON object."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(_Wire):
    """`{"type": "json_schema", "json_schema": {...}}`: JSON valid against the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


def schema_guide(schema: Mapping[str, Any] | str | bool | None) -> pb.GuidedDecoding:
    """A JSON Schema (an object, a boolean, or its JSON text) as a json_schema guide; None is
    any JSON object."""
    if schema is None:
        return pb.GuidedDecoding(json_object=True)
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return pb.GuidedDecoding(json_schema=text)


def response_format_guide(
    rf: ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema | None,
) -> pb.GuidedDecoding | None:
    """The guide of an OpenAI `response_format` (None: free text)."""
    if rf is None or isinstance(rf, ResponseFormatText):
        return None
    if isinstance(rf, ResponseFormatJsonObject):
        return pb.GuidedDecoding(json_object=True)
    return schema_guide(rf.json_schema.schema_)


def tgi_grammar_guide(grammar: Mapping[str, Any], param: str) -> pb.GuidedDecoding:
    """The guide of TGI's `grammar` parameter.

    Raises:
        GatewayError: INVALID_ARGUMENT naming `param` (e.g. "parameters.grammar") for another
            shape: a type other than "json", "json_object", "json_schema" or "regex", a value
            of the wrong JSON type, or other members.
    """
    kind = grammar.get("type")
    value = grammar.get("value")
    if set(grammar) - {"type", "value"}:
        extra = ", ".join(sorted(set(grammar) - {"type", "value"}))
        raise GatewayError.invalid(f"{param} takes only 'type' and 'value', got also: {extra}.", param)
    if kind in ("json", "json_object"):  # TGI reads "json_object" as "json"
        if not isinstance(value, dict | str):
            raise GatewayError.invalid(
                f"{param}.value must be a JSON Schema (an object or its JSON text), got {json_type(value)}.", param
            )
        return schema_guide(value)
    if kind == "regex":
        if not isinstance(value, str):
            raise GatewayError.invalid(
                f"{param}.value must be a regular expression string, got {json_type(value)}.", param
            )
        return pb.GuidedDecoding(regex=value)
    if kind == "json_schema":
        # TGI's JsonSchemaConfig; its documented example also sends `strict` (the output always
        # follows the schema here).
        if not isinstance(value, dict) or "schema" not in value or set(value) - {"name", "schema", "strict"}:
            got = f"members {sorted(value)}" if isinstance(value, dict) else json_type(value)
            raise GatewayError.invalid(
                f"{param}.value must be an object with 'schema' (and optionally 'name', 'strict'), got {got}.",
                param,
            )
        return schema_guide(value["schema"])
    raise GatewayError.invalid(
        f'{param}.type must be "json", "json_object", "json_schema" or "regex", got {json.dumps(kind)}.', param
    )


#: vLLM's guided decoding parameters, in the order vLLM checks them.
VLLM_GUIDES = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: TensorRT-LLM ensemble guide types -> our guides.
TRT_GUIDE_TYPES = {
    "json": "json_object",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "ebnf_grammar",
}


def vllm_guide(values: Mapping[str, Any]) -> pb.GuidedDecoding | None:
    """The guide of vLLM's guided_* parameters (already of their JSON types: guided_json an
    object or a string, guided_choice a list of strings, the others strings), or None.

    Raises:
        GatewayError: INVALID_ARGUMENT naming the second one when two are given.
    """
    given = [name for name in VLLM_GUIDES if values.get(name) is not None]
    if len(given) > 1:
        raise GatewayError.invalid(
            f"Only one guided decoding parameter may be given; got {given[0]} and {given[1]}.", given[1]
        )
    if not given:
        return None
    name = given[0]
    value = values[name]
    if name == "guided_json":
        return schema_guide(value)
    if name == "guided_regex":
        return pb.GuidedDecoding(regex=value)
    if name == "guided_choice":
        return pb.GuidedDecoding(choice=pb.Choices(choices=value))
    return pb.GuidedDecoding(ebnf_grammar=value)


def trt_guide(guide_type: str, guide: str | None) -> pb.GuidedDecoding:
    """The guide of TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide`.

    Raises:
        GatewayError: INVALID_ARGUMENT naming the parameter: an unknown guide type, or a missing
            guide for a type that needs one.
    """
    kind = TRT_GUIDE_TYPES.get(guide_type)
    if kind is None:
        accepted = ", ".join(TRT_GUIDE_TYPES)
        raise GatewayError.invalid(
            f"guided_decoding_guide_type must be one of {accepted}, got {json.dumps(guide_type)}.",
            "guided_decoding_guide_type",
        )
    if kind == "json_object":
        return pb.GuidedDecoding(json_object=True)
    if not guide:
        raise GatewayError.invalid(
            f"guided_decoding_guide_type {guide_type} needs guided_decoding_guide.", "guided_decoding_guide"
        )
    if kind == "json_schema":
        return pb.GuidedDecoding(json_schema=guide)
    return pb.GuidedDecoding(regex=guide) if kind == "regex" else pb.GuidedDecoding(ebnf_grammar=guide)
