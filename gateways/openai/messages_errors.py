"""Anthropic's error shape, for `/v1/messages` and `/v1/messages/count_tokens`.

Body (anthropic-sdk-python 2.10.0, `types/shared/error_response.py`, `error_type.py`):
`{"type": "error", "error": {"type", "message"}, "request_id"}`, with the `type` Anthropic gives
each status: 400 (and other 4xx, 413 included: the SDK's ErrorType has no word for it)
"invalid_request_error", 401 "authentication_error", 403 "permission_error", 404
"not_found_error", 429 "rate_limit_error", 504 "timeout_error", 529 "overloaded_error", other
5xx "api_error". Statuses are
gateways.common.status.GRPC_TO_HTTP's, except that a core that is unavailable or cancelled the
request (503 elsewhere) is Anthropic's 529, "overloaded": the Anthropic SDK retries it. After the
stream started, the same object goes in-band as an `event: error`.
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from gateways.common.framing import dumps
from gateways.common.status import GatewayError

#: gRPC code -> HTTP status entries that replace GRPC_TO_HTTP ones.
STATUS_OVERRIDES = {grpc.StatusCode.UNAVAILABLE: 529, grpc.StatusCode.CANCELLED: 529}

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: Paths whose HTTP-level errors (auth, 404, 405, 413, 415, 500) are in this shape.
PATH_PREFIX = "/v1/messages"


def error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_object(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}, "request_id"}`."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}, "request_id": request_id}


def status_of(err: GatewayError) -> int:
    """The HTTP status of an error on these routes."""
    return err.http_status(STATUS_OVERRIDES)


def render_before_stream(err: GatewayError, request_id: str | None = None) -> web.Response:
    """The error as a complete HTTP response."""
    status = status_of(err)
    return web.json_response(error_object(status, err.message, request_id), status=status, dumps=dumps)


def render_in_stream(err: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    """The object of the `event: error` that ends a stream failing after it started."""
    return error_object(status_of(err), err.message, request_id)


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error (no key, unknown method, body too large, non-JSON body, a gateway
    failure) in Anthropic's shape."""
    return web.json_response(error_object(status, message), status=status, dumps=dumps)
