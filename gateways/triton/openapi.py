"""The Triton gateway's OpenAPI document (`GET /openapi.json`, gateways.common.openapi).

The metadata responses are the pydantic models (`ModelMetadata`, `ServerMetadata`). The generate
request has no model: its parameters are an open object checked against the field table, so its
schema is written from the table itself (translate.PARAMETERS: every canonical name and alias
with its JSON type, schema.Kind), after seed `triton-generate-extension-v2.md`, "Generate Request
JSON Object" (`id`, `text_input`, `parameters`, and extra top-level members as parameters).
Unknown parameters are refused unless --ignore-unknown-parameters. The responses are built by
hand in translate.ResponseRenderer and errors.py; their schemas follow "Generate Response JSON
Object" (`id` when the request had one, `model_name`, `model_version`, `text_output`, plus the
ensemble's `output_log_probs`, `cum_log_probs`, `finish_reason`) and "Generate Response JSON
Error Object" (`{"error"}`, also the event that ends a failed stream).
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.config import GatewayConfig
from gateways.common.framing import SSE_CONTENT_TYPE
from gateways.common.schema import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from gateways.triton.config import TritonSettings
from gateways.triton.schema import Kind, ModelMetadata, ServerMetadata
from gateways.triton.translate import BY_NAME, FINISH_REASONS

_STRINGS = {"type": "array", "items": {"type": "string"}}

#: JSON Schema of each parameter kind (schema.check_value).
KINDS: dict[Kind, oa.Schema] = {
    Kind.INT32: {"type": "integer", "minimum": INT32_MIN, "maximum": INT32_MAX},
    Kind.INT64: {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX},
    Kind.FLOAT: {"type": "number"},
    Kind.BOOL: {"type": "boolean"},
    Kind.WORDS: {"anyOf": [{"type": "string"}, _STRINGS]},
    Kind.STRING: {"type": "string"},
    Kind.STRINGS: _STRINGS,
    Kind.JSON: {"type": ["object", "string"], "description": "A JSON Schema, or its JSON text."},
    Kind.INT32S: {"type": "array", "items": {"type": "integer", "minimum": INT32_MIN, "maximum": INT32_MAX}},
}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def generate_request(ignore_unknown: bool) -> oa.Schema:
    """The generate request: `text_input`, optional `id` and `parameters`; every parameter may
    also be a top-level member (once)."""
    params = {name: KINDS[spec.kind] for name, spec in sorted(BY_NAME.items())}
    return {
        "type": "object",
        "required": ["text_input"],
        "properties": {
            "id": {"type": "string"},
            "text_input": {"type": "string"},
            "parameters": {"type": "object", "properties": params, "additionalProperties": ignore_unknown},
            **params,
        },
        "additionalProperties": ignore_unknown,
    }


def generate_response(*, stream: bool) -> oa.Schema:
    """A generate response object, or one event of generate_stream (the text delta)."""
    words = sorted(set(FINISH_REASONS.values()))
    return {
        "type": "object",
        "required": ["model_name", "model_version", "text_output"],
        "properties": {
            "id": {"type": "string", "description": "The request's id, when it had one."},
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "text_output": {"type": "string", "description": "The text delta" if stream else "The whole text"},
            "output_log_probs": {"type": "array", "items": {"type": "number"}},
            "cum_log_probs": {"type": "number"},
            "finish_reason": {"enum": words},
        },
        "additionalProperties": False,
    }


def document(config: GatewayConfig, settings: TritonSettings) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of the Triton gateway (a pure function of its settings)."""
    c = oa.Components()
    error = c.add("Error", ERROR)
    request = oa.request_body(c.add("GenerateRequest", generate_request(settings.ignore_unknown_parameters)))
    event = c.add("GenerateStreamEvent", generate_response(stream=True))
    generation_errors = oa.errors_as(error, oa.GENERATION_ERRORS)
    model_errors = oa.errors_as(error, (400, 404, 500, 503, 504))
    paths: dict[str, Any] = {}
    for base, version in (("/v2/models/{model}", False), ("/v2/models/{model}/versions/{version}", True)):
        params = [oa.path_parameter("model", "The served model's name.")]
        if version:
            params.append(oa.path_parameter("version", "The served version (an integer > 0)."))
        suffix = "Version" if version else ""
        paths[base + "/generate"] = {
            "post": {
                "operationId": f"generate{suffix}",
                "summary": "Generate: one response object.",
                "parameters": params,
                "requestBody": request,
                "responses": oa.responses(
                    oa.json_content(c.add("GenerateResponse", generate_response(stream=False))), generation_errors
                ),
            }
        }
        paths[base + "/generate_stream"] = {
            "post": {
                "operationId": f"generateStream{suffix}",
                "summary": "Generate, streamed: one SSE event per text delta, the last with finish_reason.",
                "parameters": params,
                "requestBody": request,
                "responses": oa.responses(
                    oa.stream_content(SSE_CONTENT_TYPE, {"anyOf": [event, error]}),
                    generation_errors,
                    ok_description="An SSE stream; an error after it started is a last `{error}` event.",
                ),
            }
        }
        paths[base + "/ready"] = {
            "get": {
                "operationId": f"modelReady{suffix}",
                "summary": "200 (empty) when the model is served and the core is SERVING.",
                "parameters": params,
                "responses": oa.responses(None, oa.errors_as(error, (400, 404, 500))),
            }
        }
        paths[base] = {
            "get": {
                "operationId": f"modelMetadata{suffix}",
                "summary": "KServe v2 model metadata.",
                "parameters": params,
                "responses": oa.responses(oa.json_content(c.model(ModelMetadata)), model_errors),
            }
        }
    paths["/v2/health/live"] = {
        "get": {"operationId": "live", "summary": "200 while the gateway runs.", "responses": oa.responses(None, {})}
    }
    ready = oa.responses(None, {})
    ready["400"] = {"description": "The core is not SERVING (an empty body, as Triton answers)."}
    paths["/v2/health/ready"] = {
        "get": {"operationId": "ready", "summary": "200 while the core reports SERVING.", "responses": ready}
    }
    paths["/v2"] = {
        "get": {
            "operationId": "serverMetadata",
            "summary": "KServe v2 server metadata.",
            "responses": oa.responses(oa.json_content(c.model(ServerMetadata)), {}),
        }
    }
    return oa.document(
        config,
        title="Trellis Triton gateway",
        description="Triton's generate extension and KServe v2 health and metadata over the Trellis core "
        "(docs/triton.md).",
        paths=paths,
        components=c,
        error=error,
        open_paths=("/v2/health/live", "/v2/health/ready"),
    )
