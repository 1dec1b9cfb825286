"""API keys on a gateway's HTTP routes: `Authorization: Bearer <key>`, or `x-api-key: <key>`
(Anthropic's header, which its SDK sends) when there is no Authorization header. A request with
two of either is answered 400, whichever holds a key (envflags.apikeys.ApiKeys.check_all).

With `--api-key` set (one or more keys, also `TRELLIS_GATEWAY_API_KEY`, comma-separated), every
request must carry one of them, or it is answered 401 in the schema's own error shape (the
error renderer the gateway gives `make_gateway_app`: OpenAI's error object, LMI's
`{"error", "code"}`, Triton's `{"error"}`, the WebSocket gateway's `[{"error"}]`), with
`WWW-Authenticate: Bearer` (RFC 6750). A WebSocket upgrade without a key is refused with 401
before the upgrade. Health routes stay open (`HEALTH_PATHS`), so does `GET /openapi.json` (the
document declares the bearer scheme), and so does `GET /metrics` unless
`--metrics-require-key`.

Keys are checked by envflags.apikeys (SHA-256 digests compared in constant time), as the core
checks its gRPC callers (core.auth). An accepted request carries its key's identity
(`key_identity(request)`: the key's name, or a digest of an unnamed key), which
gateways.common.tenant sends as the client's tenant (GenerateRequest.tenant): its sessions
and fair share are scoped to it.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from envflags.apikeys import REPEATED, ApiKeys

#: Where an accepted request keeps its key's identity (see `key_identity`).
_IDENTITY = web.RequestKey("trellis_key_identity", str)

#: Routes that never need a key: every gateway's health checks.
HEALTH_PATHS = frozenset({"/health", "/ping", "/v2/health/live", "/v2/health/ready"})

MESSAGES = {
    "missing": "Missing API key: send the header 'Authorization: Bearer <key>'.",
    "wrong": "Invalid API key.",
    "repeated": REPEATED,
}


def key_identity(request: web.Request) -> str:
    """The identity of the API key `request` was accepted with: its name (`--api-key
    name:key`), else its digest (envflags.apikeys.ApiKeys.identity); "" on a gateway without
    keys."""
    value = request.get(_IDENTITY)
    return value if isinstance(value, str) else ""


def auth_middleware(
    keys: ApiKeys, render: Callable[[web.Request, int, str], web.Response], *, open_paths: frozenset[str]
) -> Middleware:
    """A middleware that answers requests without an accepted key with `render(request, 401,
    message)` plus `WWW-Authenticate: Bearer`, and requests with more than one credential (two
    Authorization or x-api-key headers) with `render(request, 400, message)`
    (envflags.apikeys.ApiKeys.check_all); paths in `open_paths` pass without one."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        values = request.headers.getall("Authorization", [])
        if not values:  # Anthropic's header
            values = [f"Bearer {key}" for key in request.headers.getall("x-api-key", [])]
        why = keys.check_all(values)
        if why is None:
            name = keys.name_of(values[0]) if keys.named else None
            request[_IDENTITY] = name if name is not None else ApiKeys.identity(values[0])
            return await handler(request)
        if why == "repeated":
            return render(request, 400, MESSAGES[why])
        response = render(request, 401, MESSAGES[why])
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return middleware
