"""LMI error shapes (DJL-Serving's lmi_input_output_schema.md, "Error Responses"; the rules common
to every schema are in docs/architecture.md, "Errors").

Before the first byte of a rolling-batch response:
- malformed payload (bad JSON, missing `inputs`, wrong types, unknown keys): 424
  `{"error": msg, "code": 424}`;
- body above the size limit: 413, unknown model on `/predictions/{name}`: 404, unknown path or
  wrong method: 404/405, all in the same `{"error", "code"}` shape;
- a bad parameter value or a generation failure: the HTTP status of the gRPC code
  (gateways.common.status.GRPC_TO_HTTP, with RESOURCE_EXHAUSTED -> 503 as DJL answers a full job
  queue, but 429 with the core's Retry-After for a tenant over its limits) and the body
  `{"generated_text": "", "details": {"finish_reason": "error", "generated_tokens": null,
  "inputs": null, "tokens": null}, "error": msg}`. DJL's documentation shows
  `generated_text: ""` while its code emits null; we keep the documented form, plus
  `error` so clients (the `text-generation` client reads `payload["error"]`) get the message.

After the stream started: a last record with the `id: -1` token and `finish_reason: "error"`
(in the TGI token shape under TGI compatibility), again with `error` added for the message.

Dynamic batching answers every error of its handler with `{"code": 424, "message": "invoke
handler failure", "error": msg}`: status 424, except 413 (body too large), 404 (unknown model)
and 503 (core unreachable or overloaded), which keep their status so load balancers can act on
them. An unknown path or a wrong method never reaches a handler and is answered as above.

The message of an error about a parameter leads with its LMI name ("parameters.top_p: ..."):
the routes map the core's field paths through translate.FIELDS (gateways.common.fields).
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from gateways.common.chat import errors as chat_errors
from gateways.common.framing import dumps
from gateways.common.status import GatewayError, retry_headers
from gateways.lmi import tgi_errors
from gateways.lmi.config import SETTINGS_KEY

#: LMI's departures from the generic gRPC -> HTTP table: a full queue is 503, as DJL answers it.
LMI_STATUS_OVERRIDES = {grpc.StatusCode.RESOURCE_EXHAUSTED: 503}
#: The core's reason for a tenant over its limits (core.tenants): 429, the client's own doing.
TENANT_LIMIT = "TENANT_LIMIT"

MALFORMED_PAYLOAD = "MALFORMED_PAYLOAD"
MODEL_NOT_FOUND = "MODEL_NOT_FOUND"

# Reasons rendered in the `{"error", "code"}` shape, with their HTTP status.
_SHAPE_ERRORS = {MALFORMED_PAYLOAD: 424, MODEL_NOT_FOUND: 404}
# Statuses a dynamic-batch error keeps instead of 424.
_DYNAMIC_KEPT = {413, 404, 429, 503}
# HTTP errors of the router and of API-key checks: no handler ran.
_ROUTING = {401, 404, 405}
_ROLLING_ERROR_DETAILS = {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None}


class PayloadError(GatewayError):
    """A malformed LMI payload (bad JSON, missing `inputs`, wrong types): 424 (seed "Error Responses")."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, param=param, reason=MALFORMED_PAYLOAD)


def model_not_found(name: str, served: str) -> GatewayError:
    """The error for `/predictions/{name}` naming a model that is not served (answered with 404)."""
    return GatewayError(
        grpc.StatusCode.NOT_FOUND,
        f"Model not found: '{name}'; this server serves '{served}'.",
        param="model_name",
        reason=MODEL_NOT_FOUND,
    )


def http_status(err: GatewayError) -> int:
    """The HTTP status of an error answered before the stream started (rolling batch)."""
    if err.reason in _SHAPE_ERRORS:
        return _SHAPE_ERRORS[err.reason]
    if err.reason == TENANT_LIMIT:
        return 429
    return err.http_status(LMI_STATUS_OVERRIDES)


def error_body(err: GatewayError) -> dict[str, Any]:
    """The rolling-batch JSON body of an error answered before the stream started."""
    if err.reason in _SHAPE_ERRORS:
        return {"error": err.message, "code": _SHAPE_ERRORS[err.reason]}
    return _rolling_error(err.message)


def _rolling_error(message: str) -> dict[str, Any]:
    return {"generated_text": "", "details": dict(_ROLLING_ERROR_DETAILS), "error": message}


def render_before_stream(err: GatewayError, *, dynamic: bool = False) -> web.Response:
    """The HTTP response for an error found before the first byte.

    Args:
        err: the error (gateway-found or decoded from the core's status).
        dynamic: render in the dynamic-batch shape.
    """
    if dynamic:
        status, body = dynamic_error(err)
    else:
        status, body = http_status(err), error_body(err)
    response = _json(status, body)
    response.headers.update(retry_headers(err))
    return response


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error, for the error middleware (gateways.common.app): an unknown path or a
    wrong method in the `{"error", "code"}` shape; a body too large (413) or a gateway failure
    (500) in the shape of the batching mode (rolling: `{"error", "code"}` for 413, the error body
    for 500; dynamic: `dynamic_error`'s). On TGI's routes the shape is TGI's (or OpenAI's on
    its OpenAI-compatible routes), whatever the batching mode."""
    if request.path in tgi_errors.TGI_PATHS:
        return tgi_errors.render_http_error(status, message)
    if request.path in tgi_errors.OPENAI_PATHS:
        return chat_errors.render_http_error(request, status, message)
    if request.app[SETTINGS_KEY].dynamic and status not in _ROUTING:
        kept = status if status in _DYNAMIC_KEPT else 424
        return _json(kept, _dynamic_body(kept, message))
    if status >= 500:
        return _json(status, _rolling_error(message))
    return _json(status, {"error": message, "code": status})


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def render_in_stream(err: GatewayError, *, tgi_compat: bool = False) -> dict[str, Any]:
    """The last record of a rolling-batch stream that failed after it started (framed as a
    jsonlines line or an SSE event by the caller)."""
    if tgi_compat:
        token = {"id": -1, "text": "", "logprob": -1, "special": True}
    else:
        token = {"id": -1, "text": "", "log_prob": -1, "special_token": True}
    return {
        "token": token,
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
        "error": err.message,
    }


def dynamic_error(err: GatewayError) -> tuple[int, dict[str, Any]]:
    """Status and body of a dynamic-batch error (also the in-band record of a failed
    dynamic-batch stream)."""
    status = http_status(err)
    status = status if status in _DYNAMIC_KEPT else 424
    return status, _dynamic_body(status, err.message)


def _dynamic_body(status: int, message: str) -> dict[str, Any]:
    return {"code": status, "message": "invoke handler failure", "error": message}
