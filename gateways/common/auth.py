"""API keys on a gateway's HTTP routes: `Authorization: Bearer <key>`.

With `--api-key` set (one or more keys, also `TRELLIS_GATEWAY_API_KEY`, comma-separated), every
request must carry one of them, or it is answered 401 in the schema's own error shape (the
error renderer the gateway gives `make_gateway_app`: OpenAI's error object, LMI's
`{"error", "code"}`, Triton's `{"error"}`, the WebSocket gateway's `[{"error"}]`), with
`WWW-Authenticate: Bearer` (RFC 6750). A WebSocket upgrade without a key is refused with 401
before the upgrade. Health routes stay open (`HEALTH_PATHS`), and so does `GET /metrics` unless
`--metrics-require-key`.

Keys are compared as SHA-256 digests with `hmac.compare_digest` against every configured key, so
the time taken tells nothing about a key (the core checks its gRPC callers the same way,
core.auth).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

#: Routes that never need a key: every gateway's health checks.
HEALTH_PATHS = frozenset({"/health", "/ping", "/v2/health/live", "/v2/health/ready"})

MISSING = "Missing API key: send the header 'Authorization: Bearer <key>'."
WRONG = "Invalid API key."


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests.

    Args:
        keys: the accepted keys (at least one).
    """

    def __init__(self, keys: Iterable[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` ("Bearer <key>", scheme in any case) carries an accepted
        key; else why not (MISSING or WRONG)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for known in self._digests:  # every key, always: no early exit
            ok |= hmac.compare_digest(known, digest)
        return None if ok else WRONG


def auth_middleware(
    keys: ApiKeys, render: Callable[[web.Request, int, str], web.Response], *, open_paths: frozenset[str]
) -> Middleware:
    """A middleware that answers requests without an accepted key with `render(request, 401,
    message)` plus `WWW-Authenticate: Bearer`; paths in `open_paths` pass without one."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        why = keys.check(request.headers.get("Authorization"))
        if why is None:
            return await handler(request)
        response = render(request, 401, why)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return middleware
