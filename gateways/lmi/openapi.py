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

TGI's own routes (gateways.lmi.tgi_routes) are described from text-generation-inference's
router/src/lib.rs (`GenerateResponse`, `Details`, `BestOfSequence`, `StreamResponse`,
`StreamDetails`, `SimpleToken`, `Info`, `ErrorResponse`); its OpenAI-compatible routes reuse the OpenAI
gateway's schemas, and the chat schemas list the finish reasons of both routes that serve them.
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.chat import openapi as chat
from gateways.common.chat.completion_schema import CompletionRequest
from gateways.common.chat.openapi import text_completion
from gateways.common.chat.translate import FINISH_REASONS as OPENAI_FINISH_REASONS
from gateways.common.config import GatewayConfig
from gateways.common.framing import JSONLINES_CONTENT_TYPE, SSE_CONTENT_TYPE
from gateways.lmi import adapters
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


#: TGI's `ErrorResponse`.
TGI_ERROR = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "additionalProperties": False,
}
_TGI_ERRORS = (413, 415, 422, 424, 429, 500, 503, 504)
#: TGI's `SimpleToken` (`POST /tokenize`).
SIMPLE_TOKEN = {
    "type": "object",
    "required": ["id", "text", "start", "stop"],
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "start": {"type": "integer", "minimum": 0},
        "stop": {"type": "integer", "minimum": 0},
    },
    "additionalProperties": False,
}


def _tgi_details(words: list[str], *, stream: bool) -> oa.Schema:
    """TGI's `Details` (whole response; `best_of_sequences` entries are its `BestOfSequence`) or
    `StreamDetails` (a stream's last event)."""
    common: dict[str, Any] = {
        "finish_reason": {"enum": words},
        "generated_tokens": {"type": "integer", "minimum": 0},
        "seed": _INT_OR_NULL,
    }
    if stream:
        props = {**common, "input_length": {"type": "integer", "minimum": 0}}
        return {"type": "object", "required": list(props), "properties": props, "additionalProperties": False}
    sequence = {
        **common,
        "prefill": {"type": "array", "items": oa.ref("TgiPrefillToken")},
        "tokens": {"type": "array", "items": oa.ref("TgiToken")},
        "top_tokens": {"type": "array", "items": {"type": "array", "items": oa.ref("TgiAlternative")}},
    }
    best_of = {
        "type": "object",
        "required": ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"],
        "properties": {"generated_text": {"type": "string"}, **sequence},
        "additionalProperties": False,
    }
    props = {**sequence, "best_of_sequences": {"type": "array", "items": best_of}}
    return {
        "type": "object",
        "required": ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"],
        "properties": props,
        "additionalProperties": False,
    }


def _tgi_paths(c: oa.Components, words: list[str], chat_refs: dict[str, Any]) -> dict[str, Any]:
    """The paths of TGI's routes."""
    c.add("TgiToken", token(True))
    c.add("TgiAlternative", alternative(True))
    c.add(
        "TgiPrefillToken",
        {
            "type": "object",
            "required": ["id", "text", "logprob"],
            "properties": {
                "id": {"type": "integer"},
                "text": {"type": "string"},
                "logprob": {"type": ["number", "null"]},
                "top_tokens": {"type": "array", "items": oa.ref("TgiAlternative")},
            },
            "additionalProperties": False,
        },
    )
    error = c.add("TgiError", TGI_ERROR)
    response = c.add(
        "TgiGenerateResponse",
        {
            "type": "object",
            "required": ["generated_text"],
            "properties": {"generated_text": {"type": "string"}, "details": _tgi_details(words, stream=False)},
            "additionalProperties": False,
        },
    )
    event = c.add(
        "TgiStreamResponse",
        {
            "type": "object",
            "required": ["index", "token", "generated_text", "details"],
            "properties": {
                "index": {"type": "integer", "minimum": 1},
                "token": oa.ref("TgiToken"),
                "top_tokens": {"type": "array", "items": oa.ref("TgiAlternative")},
                "generated_text": {"type": ["string", "null"]},
                "details": {"anyOf": [{"type": "null"}, _tgi_details(words, stream=True)]},
            },
            "additionalProperties": False,
        },
    )
    request = oa.request_body(
        c.model(RollingBatchRequest),
        description="TGI's GenerateRequest `{inputs, parameters}` (`stream` chooses the answer on `POST /` "
        "only); the parameters are TGI's GenerateParameters with LMI's additions.",
    )
    stream = oa.stream_content(SSE_CONTENT_TYPE, {"anyOf": [event, error]})
    errors = oa.errors_as(error, _TGI_ERRORS)
    info_props: dict[str, Any] = {
        "model_id": {"type": "string"},
        "model_sha": {"type": ["string", "null"]},
        "model_pipeline_tag": {"type": ["string", "null"]},
        "max_concurrent_requests": _INT_OR_NULL,
        "max_best_of": {"type": "integer"},
        "max_stop_sequences": {"type": "integer"},
        "max_input_tokens": {"type": "integer"},
        "max_total_tokens": {"type": "integer"},
        "validation_workers": _INT_OR_NULL,
        "max_client_batch_size": _INT_OR_NULL,
        "router": {"type": "string"},
        "version": {"type": "string"},
        "sha": {"type": ["string", "null"]},
        "docker_label": {"type": ["string", "null"]},
    }
    info = {"type": "object", "required": list(info_props), "properties": info_props, "additionalProperties": False}

    def health(operation_id: str) -> dict[str, Any]:
        return {
            "operationId": operation_id,
            "summary": "TGI's health check: 200 (no body) while the core reports SERVING, else 503.",
            "responses": oa.responses(None, {503: error}),
        }

    chat_error = chat_refs["error"]

    def openai_sse(item: oa.Schema) -> dict[str, Any]:
        return oa.stream_content(SSE_CONTENT_TYPE, {"anyOf": [item, chat_error]}, done=True)

    openai_errors = oa.errors_as(chat_error, (*oa.GENERATION_ERRORS, 415))
    return {
        "/": {
            "get": health("tgiRootHealth"),
            "post": {
                "operationId": "tgiCompatGenerate",
                "summary": "TGI's compat route: /generate (the body in a one-element array) or, with "
                "`stream: true`, /generate_stream.",
                "requestBody": request,
                "responses": oa.responses(
                    {**oa.json_content({"type": "array", "items": response, "maxItems": 1}), **stream}, errors
                ),
            },
        },
        "/generate": {
            "post": {
                "operationId": "tgiGenerate",
                "summary": "TGI's generate.",
                "requestBody": request,
                "responses": oa.responses(oa.json_content(response), errors),
            }
        },
        "/generate_stream": {
            "post": {
                "operationId": "tgiGenerateStream",
                "summary": "TGI's generate_stream: one SSE event per token; an error after the stream "
                "started is its last event.",
                "requestBody": request,
                "responses": oa.responses(stream, errors),
            }
        },
        "/tokenize": {
            "post": {
                "operationId": "tgiTokenize",
                "summary": "TGI's tokenize: each token of `inputs` with its text and UTF-8 byte offsets.",
                "requestBody": request,
                "responses": oa.responses(
                    oa.json_content({"type": "array", "items": c.add("TgiSimpleToken", SIMPLE_TOKEN)}),
                    oa.errors_as(error, (413, 415, 422, 424, 500, 503, 504)),
                ),
            }
        },
        "/health": {"get": health("tgiHealth")},
        "/info": {
            "get": {
                "operationId": "tgiInfo",
                "summary": "TGI's Info object for the served model.",
                "responses": oa.responses(
                    oa.json_content(c.add("TgiInfo", info)), oa.errors_as(error, (424, 500, 503, 504))
                ),
            }
        },
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "summary": "TGI's OpenAI-compatible chat completions (the OpenAI gateway's route).",
                "requestBody": oa.request_body(chat_refs["request"]),
                "responses": oa.responses(
                    {**oa.json_content(chat_refs["completion"]), **openai_sse(chat_refs["chunk"])}, openai_errors
                ),
            }
        },
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "summary": "TGI's OpenAI-compatible legacy completions (the OpenAI gateway's route).",
                "requestBody": oa.request_body(c.model(CompletionRequest, extra=chat.ignored_fields())),
                "responses": oa.responses(
                    {
                        **oa.json_content(c.add("TextCompletion", text_completion(_OPENAI_WORDS, chunk=False))),
                        **openai_sse(c.add("TextCompletionChunk", text_completion(_OPENAI_WORDS, chunk=True))),
                    },
                    openai_errors,
                ),
            }
        },
    }


#: The finish reasons of the OpenAI-compatible routes (OpenAI's table).
_OPENAI_WORDS = sorted(set(OPENAI_FINISH_REASONS.values()))


def document(config: GatewayConfig, settings: LmiSettings) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of the LMI gateway (a pure function of its settings)."""
    c = oa.Components()
    words = sorted(set(FINISH_REASONS.values()))
    # Chat bodies are served on /invocations (LMI's finish reasons) and /v1/chat/completions
    # (OpenAI's): one set of chat schemas lists both.
    refs = chat.add_chat(c, sorted({*words, *_OPENAI_WORDS}))
    c.add("LmiError", SHAPE_ERROR)
    c.add("RollingBatchError", ROLLING_ERROR)
    c.add("DynamicBatchError", DYNAMIC_ERROR)
    tgi_paths = _tgi_paths(c, words, refs)
    statuses: tuple[int, ...]
    if settings.dynamic:
        request, body, item = _dynamic(c)
        statuses = (400, 404, 413, 424, 500, 503, 504)
    else:
        request, body, item = _rolling(c, settings.tgi_compat, words)
        statuses = (400, 404, 413, 415, 424, 500, 503, 504)
    error = c.add(
        "Error",
        {
            "anyOf": [
                oa.ref("LmiError"),
                oa.ref("RollingBatchError"),
                oa.ref("DynamicBatchError"),
                refs["error"],
                oa.ref("TgiError"),
            ]
        },
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
        **adapters.openapi_paths(c.add("ManagementError", adapters.ERROR_SCHEMA)),
        **tgi_paths,
    }
    return oa.document(
        config,
        title="Trellis LMI gateway",
        description="DJL-Serving LMI's inference routes, and Hugging Face TGI's, over the Trellis core (docs/lmi.md).",
        paths=paths,
        components=c,
        error=oa.ref("Error"),
        open_paths=("/ping", "/health"),
    )
