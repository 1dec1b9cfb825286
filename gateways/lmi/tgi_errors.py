"""Error shapes of TGI's routes on the LMI gateway (gateways.lmi.tgi_routes).

TGI answers every error with `{"error": message, "error_type": type}` (text-generation-inference
router/src/lib.rs `ErrorResponse`), with the status of its `InferError` (router/src/server.rs,
`impl From<InferError> for (StatusCode, Json<ErrorResponse>)`): validation 422, overloaded 429,
generation 424, incomplete_generation 500. A stream that fails after it started ends with one
SSE event of the same object. The `text-generation` and `huggingface_hub` clients raise their
own exception per `error_type` (ValidationError, OverloadedError, GenerationError,
IncompleteGenerationError); other types fall back to the status.

The core's gRPC codes map onto them as follows:
- INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION, and a malformed payload (not JSON, a
  wrong type, an unknown key): 422 `validation`;
- RESOURCE_EXHAUSTED (the core's queue is full): 429 `overloaded`;
- a stream that ended without its final message: 500 `incomplete_generation`;
- UNAVAILABLE and CANCELLED (core unreachable, starting or draining): 503 `unavailable`, and
  DEADLINE_EXCEEDED (--request-timeout): 504 `timeout` (TGI has no such cases; the statuses are
  the ones every Trellis schema uses, which TGI's clients read as a shard not ready / timeout);
- anything else the engine reports (INTERNAL, UNKNOWN, ...): 424 `generation`.
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from gateways.common.framing import dumps
from gateways.common.status import GatewayError, retry_headers

VALIDATION = "validation"

#: The paths of TGI's routes that answer in TGI's shapes (gateways.lmi.tgi_routes).
TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/tokenize", "/health", "/info"})
#: TGI's OpenAI-compatible routes, which answer in OpenAI's shapes.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

#: gRPC code -> (HTTP status, TGI error_type); codes not listed are a generation error.
_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (422, VALIDATION),
    grpc.StatusCode.OUT_OF_RANGE: (422, VALIDATION),
    grpc.StatusCode.FAILED_PRECONDITION: (422, VALIDATION),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable"),
    grpc.StatusCode.CANCELLED: (503, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_GENERATION = (424, "generation")
_INCOMPLETE = (500, "incomplete_generation")

#: HTTP-level errors (no handler answered): status -> error_type.
_HTTP_TYPES = {401: "authentication", 405: "method_not_allowed", 413: VALIDATION, 415: VALIDATION}


def status_and_type(err: GatewayError) -> tuple[int, str]:
    """The HTTP status and TGI `error_type` of an error (module docstring)."""
    if err.reason == "INCOMPLETE_STREAM":
        return _INCOMPLETE
    return _BY_CODE.get(err.code, _GENERATION)


def error_body(message: str, error_type: str) -> dict[str, str]:
    """TGI's `ErrorResponse`."""
    return {"error": message, "error_type": error_type}


def render_before_stream(err: GatewayError) -> web.Response:
    """The response for an error found before the first byte."""
    status, error_type = status_and_type(err)
    response = json_response(status, error_body(err.message, error_type))
    response.headers.update(retry_headers(err))
    return response


def render_in_stream(err: GatewayError) -> dict[str, str]:
    """The event that ends a TGI stream failing after it started (framed as SSE by the caller)."""
    return error_body(err.message, status_and_type(err)[1])


def render_http_error(status: int, message: str) -> web.Response:
    """An HTTP-level error on a TGI route (wrong method, body too large or not JSON, a missing
    API key, a gateway failure) in TGI's shape: 5xx is `internal`, the rest `validation`
    unless `_HTTP_TYPES` names it."""
    error_type = _HTTP_TYPES.get(status, "internal" if status >= 500 else VALIDATION)
    return json_response(status, error_body(message, error_type))


def json_response(status: int, body: Any) -> web.Response:
    """A JSON response (orjson, as every Trellis body)."""
    return web.Response(status=status, text=dumps(body), content_type="application/json")
