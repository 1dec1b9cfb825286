"""The LMI gateway's OpenAPI document (`GET /openapi.json`, gateways.common.openapi).

The request bodies are the pydantic models: `RollingBatchRequest` or `DynamicBatchRequest` (by
--batching), or a chat completions body (`ChatCompletionRequest`, gateways.common.chat.openapi).
The responses are built by hand in gateways.lmi.translate and gateways.lmi.errors; their schemas
are written here from DJL-Serving's `lmi_input_output_schema.md`: "Response Schema" (non-streaming body,
jsonlines/SSE records), "Token", "Details", "BestOfSequence", "Response with TGI compatibility"
(token fields `logprob`/`special`, a one-element array, `seed`, `prefill`), "Error Responses"
(424 `{"error", "code"}`, the error body with `finish_reason: "error"` and the last stream line),
and "Dynamic Batch/Static Batch Schema" (`[{generated_text}]`, `{"outputs": [...]}` lines,
`{"code", "message", "error"}`). The document follows the gateway's settings: the token
spelling of --tgi-compat, and the request and response shapes of --batching.
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.chat import openapi as chat
from gateways.common.config import GatewayConfig
from gateways.common.framing import JSONLINES_CONTENT_TYPE, SSE_CONTENT_TYPE
from gateways.lmi.config import LmiSettings
from gateways.lmi.schema import DynamicBatchRequest, RollingBatchRequest
from gateways.lmi.translate import FINISH_REASONS

_INT_OR_NULL = {"type": ["integer", "null"]}


def token(tgi: bool) -> oa.Schema:
    """A generated token (seed "Token"; TGI's spelling under --tgi-compat). `id` -1 is the
    record that ends a stream without a token of its own, or with an error."""
    if tgi:
        props = {"logprob": {"type": ["number", "null"]}, "special": {"type": "boolean"}}
    else:
        props = {"log_prob": {"type": ["number", "null"]}, "special_token": {"const": True}}
    return {
        "type": "object",
        "required": ["id", "text", *(["logprob", "special"] if tgi else ["log_prob"])],
        "properties": {"id": {"type": "integer"}, "text": {"type": "string"}, **props},
        "additionalProperties": False,
    }


def alternative(tgi: bool) -> oa.Schema:
    """One of `top_tokens`: `{id, text, log_prob}` (TGI: `{id, text, logprob, special}`)."""
    logprob = "logprob" if tgi else "log_prob"
    props: dict[str, Any] = {"id": {"type": "integer"}, "text": {"type": "string"}, logprob: {"type": "number"}}
    if tgi:
        props["special"] = {"type": "boolean"}
    return {"type": "object", "required": list(props), "properties": props, "additionalProperties": False}


def prefill_token(tgi: bool) -> oa.Schema:
    """A prompt token of `details.prefill` (the first has no logprob)."""
    logprob = "logprob" if tgi else "log_prob"
    return {
        "type": "object",
        "required": ["id", "text", logprob],
        "properties": {
            "id": {"type": "integer"},
            "text": {"type": "string"},
            logprob: {"type": ["number", "null"]},
            "top_tokens": {"type": "array", "items": oa.ref("Alternative")},
        },
        "additionalProperties": False,
    }


def _details(words: list[str], *, stream: bool) -> oa.Schema:
    """`details` (seed "Details"): with `tokens` in a whole response, without on a stream's last
    record."""
    props: dict[str, Any] = {
        "finish_reason": {"enum": words},
        "generated_tokens": {"type": "integer", "minimum": 0},
        "inputs": {"type": "string"},
        "prefill": {"type": "array", "items": oa.ref("PrefillToken")},
        "seed": _INT_OR_NULL,
    }
    required = ["finish_reason", "generated_tokens", "inputs"]
    if not stream:
        props["tokens"] = {"type": "array", "items": oa.ref("Token")}
        props["top_tokens"] = {"type": "array", "items": {"type": "array", "items": oa.ref("Alternative")}}
        props["best_of_sequences"] = {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["generated_text", "finish_reason", "generated_tokens", "tokens"],
                "properties": {"generated_text": {"type": "string"}, **props},
            },
        }
        required.append("tokens")
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}


#: The error body before the stream for a bad parameter value or an engine failure (LMI's "Error
#: Responses"; `error` added for the message, see gateways.lmi.errors).
ROLLING_ERROR = {
    "type": "object",
    "required": ["generated_text", "details", "error"],
    "properties": {
        "generated_text": {"const": ""},
        "details": {
            "type": "object",
            "required": ["finish_reason", "generated_tokens", "inputs", "tokens"],
            "properties": {
                "finish_reason": {"const": "error"},
                "generated_tokens": {"type": "null"},
                "inputs": {"type": "null"},
                "tokens": {"type": "null"},
            },
        },
        "error": {"type": "string"},
    },
}

#: `{"error", "code"}`: a malformed payload (424), an unknown model (404), path or method, a
#: body too large (413) or not JSON (415).
SHAPE_ERROR = {
    "type": "object",
    "required": ["error", "code"],
    "properties": {"error": {"type": "string"}, "code": {"type": "integer"}},
}

#: Every error of dynamic batching's handler (seed "Dynamic Batch/Static Batch Schema", "Error
#: Responses"), also its in-band line.
DYNAMIC_ERROR = {
    "type": "object",
    "required": ["code", "message", "error"],
    "properties": {
        "code": {"type": "integer"},
        "message": {"const": "invoke handler failure"},
        "error": {"type": "string"},
    },
}


def _stream_error(tgi: bool) -> oa.Schema:
    """The last record of a stream that failed after it started (seed "Error Responses")."""
    return {
        "type": "object",
        "required": ["token", "generated_text", "details", "error"],
        "properties": {
            "token": oa.ref("Token"),
            "generated_text": {"const": ""},
            "details": {
                "type": "object",
                "required": ["finish_reason", "generated_tokens", "inputs"],
                "properties": {
                    "finish_reason": {"const": "error"},
                    "generated_tokens": {"type": "null"},
                    "inputs": {"type": "null"},
                },
            },
            "error": {"type": "string"},
        },
    }


def _rolling(c: oa.Components, tgi: bool, words: list[str]) -> tuple[oa.Schema, oa.Schema, oa.Schema]:
    """Request, whole response and stream item of rolling batching."""
    c.add("Token", token(tgi))
    c.add("Alternative", alternative(tgi))
    c.add("PrefillToken", prefill_token(tgi))
    response = {
        "type": "object",
        "required": ["generated_text"],
        "properties": {"generated_text": {"type": "string"}, "details": _details(words, stream=False)},
        "additionalProperties": False,
    }
    record = {
        "type": "object",
        "required": ["token"],
        "properties": {
            "token": oa.ref("Token"),
            "top_tokens": {"type": "array", "items": oa.ref("Alternative")},
            "generated_text": {"type": "string"},
            "details": _details(words, stream=True),
        },
        "additionalProperties": False,
    }
    body = c.add("RollingBatchResponse", {"type": "array", "items": response, "maxItems": 1} if tgi else response)
    item = {"anyOf": [c.add("RollingBatchRecord", record), c.add("RollingBatchStreamError", _stream_error(tgi))]}
    return c.model(RollingBatchRequest), body, item


def _dynamic(c: oa.Components) -> tuple[oa.Schema, oa.Schema, oa.Schema]:
    """Request, whole response and stream item of dynamic batching."""
    body = {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["generated_text"],
            "properties": {"generated_text": {"type": "string"}},
            "additionalProperties": False,
        },
    }
    line = {
        "type": "object",
        "required": ["outputs"],
        "properties": {"outputs": {"type": "array", "items": {"type": "string"}}},
        "additionalProperties": False,
    }
    item = {"anyOf": [c.add("DynamicBatchLine", line), oa.ref("DynamicBatchError")]}
    return c.model(DynamicBatchRequest), c.add("DynamicBatchResponse", body), item


def document(config: GatewayConfig, settings: LmiSettings) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of the LMI gateway (a pure function of its settings)."""
    c = oa.Components()
    words = sorted(set(FINISH_REASONS.values()))
    refs = chat.add_chat(c, words)
    c.add("LmiError", SHAPE_ERROR)
    c.add("RollingBatchError", ROLLING_ERROR)
    c.add("DynamicBatchError", DYNAMIC_ERROR)
    statuses: tuple[int, ...]
    if settings.dynamic:
        request, body, item = _dynamic(c)
        statuses = (400, 404, 413, 424, 500, 503, 504)
    else:
        request, body, item = _rolling(c, settings.tgi_compat, words)
        statuses = (400, 404, 413, 415, 424, 500, 503, 504)
    error = c.add(
        "Error",
        {"anyOf": [oa.ref("LmiError"), oa.ref("RollingBatchError"), oa.ref("DynamicBatchError"), refs["error"]]},
    )
    stream_item = {"anyOf": [item, refs["chunk"], refs["error"]]}
    operation = {
        "requestBody": oa.request_body(
            {"anyOf": [request, refs["request"]]},
            description="An LMI request (`inputs`), or a chat completions request (`messages`).",
        ),
        "responses": oa.responses(
            {
                **oa.json_content({"anyOf": [body, refs["completion"]]}),
                **oa.stream_content(JSONLINES_CONTENT_TYPE, stream_item),
                **oa.stream_content(SSE_CONTENT_TYPE, stream_item, done=True),
            },
            oa.errors_as(error, statuses),
            ok_description="The whole answer (application/json), or with `stream` one record per token as JSON "
            "lines or SSE (`Accept`, --output-formatter, --tgi-compat choose); an error after the stream "
            "started is its last record.",
        ),
    }
    paths = {
        "/invocations": {"post": {"operationId": "invocations", "summary": "Generate (SageMaker route).", **operation}},
        "/predictions/{model_name}": {
            "post": {
                "operationId": "predictions",
                "summary": "Generate with the model named in the path; 404 for any other name.",
                "parameters": [oa.path_parameter("model_name", "The served model's name.")],
                **operation,
            }
        },
        "/ping": oa.health_path("ping", "Healthy", "Unhealthy"),
    }
    return oa.document(
        config,
        title="Trellis LMI gateway",
        description="DJL-Serving LMI's inference routes over the Trellis core (docs/lmi.md).",
        paths=paths,
        components=c,
        error=oa.ref("LmiError"),
        open_paths=("/ping",),
    )
