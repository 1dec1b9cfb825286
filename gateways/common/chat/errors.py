"""OpenAI's error object, before and after the first byte (docs/architecture.md, "Errors"); the
error shape of the OpenAI gateway, and of chat completions on the LMI gateway.

Before the stream starts: the HTTP status from `gateways.common.status.GRPC_TO_HTTP` (with
a caller's overrides on top) and the body
`{"error": {"message", "type", "param", "code"}}`. After it started: the same object in-band
(`data: {"error": ...}` then `data: [DONE]` on SSE; one JSON line on jsonlines), since the
status is already sent.

`type` follows OpenAI's vocabulary by HTTP status: 400/404/409/413/422
"invalid_request_error", 401 "authentication_error", 403 "permission_error", 429
"rate_limit_error", 5xx "server_error". `code` is the core's ErrorInfo reason in lower case
("model_not_found", "context_length_exceeded", "queue_full", ...), else the gateway's own; `param` is the
OpenAI parameter name (see translate.client_names), or null.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from aiohttp import web

from gateways.common.framing import dumps
from gateways.common.status import GatewayError, retry_headers

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_object(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def _code(err: GatewayError) -> str | None:
    return err.reason.lower() if err.reason else None


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    """An error response with OpenAI's body, for errors found outside a GatewayError (an unknown
    model on `/v1/models/{model}`)."""
    return web.json_response(error_object(message, status, param=param, code=code), status=status, dumps=dumps)


#: The `code` of HTTP-level errors (found before any handler ran, or around it).
HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    500: "internal",
}


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error (unknown path, wrong method, body too large, a non-JSON body, a
    gateway failure) in OpenAI's shape, for the error middleware (gateways.common.app); `code`
    from HTTP_CODES."""
    return error_response(status, message, code=HTTP_CODES.get(status, "http_error"))


def render_before_stream(err: GatewayError, overrides: Mapping[grpc.StatusCode, int] | None = None) -> web.Response:
    """The error as a complete HTTP response (status from the gRPC code, then overrides).

    `err.param` must already be in OpenAI's spelling. A refusal with the core's retry delay (a
    tenant over its limits) carries it as Retry-After.
    """
    response = error_response(err.http_status(overrides), err.message, param=err.param, code=_code(err))
    response.headers.update(retry_headers(err))
    return response


def render_in_stream(err: GatewayError, overrides: Mapping[grpc.StatusCode, int] | None = None) -> dict[str, Any]:
    """The error object to send in-band, after the status line went out.

    `type` still follows the status the error would have had before the stream started.
    """
    return error_object(err.message, err.http_status(overrides), param=err.param, code=_code(err))
