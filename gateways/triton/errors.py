"""Triton's error shapes (Triton's extension_generate.md, "Generate Response JSON Error Object").

Before the first byte: the HTTP status of the gRPC code (gateways.common.status.GRPC_TO_HTTP:
400 for bad input, 404 unknown model or version, 429 queue full, 503 core unavailable, 500
engine failure) with an `application/json` body `{"error": msg}`. After a /generate_stream
response started: one SSE event `data: {"error": msg}`, after which the stream ends; the status
stays 200 (extension_generate.md: "the user must always check whether an error object is
received").

The message of an error about a parameter leads with the name the client used ("max_tokens:
..."): the routes map the core's field paths through translate.FIELDS (Translation.names).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from gateways.common.fields import client_error
from gateways.common.framing import dumps, sse_event
from gateways.common.status import GatewayError, retry_headers


def error_response(status: int, message: str) -> web.Response:
    """`$generate_error_response`, `{"error": message}`, with `status`, as application/json."""
    return web.json_response({"error": message}, status=status, dumps=dumps)


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error (unknown path 404, wrong method 405, body too large 413, a gateway
    failure 500) as `{"error": msg}`, for the error middleware (gateways.common.app)."""
    return error_response(status, message)


def render_before_stream(err: GatewayError, names: Mapping[str, str] | None = None) -> web.Response:
    """The error as a complete response; `names` maps core field paths to the client's parameter
    names (Translation.names)."""
    response = error_response(err.http_status(), client_error(err, names or {}).message)
    response.headers.update(retry_headers(err))
    return response


def render_in_stream(err: GatewayError, names: Mapping[str, str] | None = None) -> bytes:
    """The error as the SSE event that ends a started /generate_stream response."""
    return sse_event({"error": client_error(err, names or {}).message})
