"""Who a gateway's request is served for: the tenant the core shares its engine by
(core.scheduling, core.tenants; docs/fleet.md).

On a gateway with `--api-key`, the tenant is the name of the client's key (`--api-key
name:key`), or for an unnamed key an opaque digest of it (gateways.common.auth.key_identity):
it is authenticated, so it also scopes the client's continue-generation sessions in the core.
On a gateway without keys it is the `x-gateway-inference-fairness-id` header (the Gateway API
Inference Extension's flow-control header, llm-d's name for a fairness key), else none (the
core's default tenant); there the header is the client's own word, as the session id is. A
middleware reads it once per HTTP request (or WebSocket upgrade) into a context variable, which
`CoreClient.generate` copies into the requests it starts from that request's task
(`GenerateRequest.tenant`), so no schema's translation needs to know about it. The core checks
the name's length (at most 128 characters).
"""

from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from envflags.apikeys import ApiKeys
from gateways.common.auth import key_identity

#: The request header that names a tenant (gateway-api-inference-extension, llm-d flow control).
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"

_TENANT: ContextVar[str] = ContextVar("trellis_gateway_tenant", default="")


def current_tenant() -> str:
    """The tenant of the HTTP request whose task is running ("" for none)."""
    return _TENANT.get()


def tenant_of(request: web.Request, keys: ApiKeys | None) -> str:
    """The tenant of `request`: with `keys`, the identity the auth middleware recorded when it
    accepted the key (its name, or its digest for an unnamed key); without keys, the fairness
    header (stripped; the first when repeated), else ""."""
    if keys is None:
        return request.headers.get(FAIRNESS_HEADER, "").strip()
    return key_identity(request)


def tenant_middleware(keys: ApiKeys | None) -> Middleware:
    """A middleware that sets `current_tenant()` for the handler (after the key check)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        token = _TENANT.set(tenant_of(request, keys))
        try:
            return await handler(request)
        finally:
            _TENANT.reset(token)

    return middleware
