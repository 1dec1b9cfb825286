"""API keys on the core's gRPC server: a grpc.aio server interceptor.

With `--api-key` set (one or more keys), every call must carry the metadata
`authorization: Bearer <key>` with one of them, or it ends with UNAUTHENTICATED before the
servicer runs; a call with several `authorization` entries ends with INVALID_ARGUMENT, as a
gateway answers two Authorization headers with 400 (envflags.apikeys.ApiKeys.check_all).
grpc.health.v1 stays open, so load balancers and Kubernetes probes need no key. Keys are
checked by envflags.apikeys (SHA-256 digests compared in constant time).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc

from envflags.apikeys import REPEATED, ApiKeys

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

#: Method prefixes served without a key.
OPEN_METHODS = ("/grpc.health.v1.Health/",)

MESSAGES = {
    "missing": "Missing API key: send the metadata 'authorization: Bearer <key>'.",
    "wrong": "Invalid API key.",
    "repeated": REPEATED,
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted key with UNAUTHENTICATED (see the module docstring)."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        """The method's handler, or one that ends the call with UNAUTHENTICATED."""
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        values = [v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"]
        why = self.keys.check_all([v if isinstance(v, str) else "" for v in values])
        if why is None:
            return handler
        code = grpc.StatusCode.INVALID_ARGUMENT if why == "repeated" else grpc.StatusCode.UNAUTHENTICATED
        return _refusal(handler, code, MESSAGES[why])


def caller_identity(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The identity of the API key a call carries (envflags.apikeys.ApiKeys.identity of its one
    `authorization` entry; "" without one), for a core with keys: the interceptor let only calls
    with one accepted key through."""
    values = [v for k, v in metadata or () if k == "authorization" and isinstance(v, str)]
    return ApiKeys.identity(values[0]) if len(values) == 1 else ""


def _refusal(
    handler: grpc.RpcMethodHandler[_Req, _Resp], code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[_Req, _Resp]:
    """A handler of the same kind as `handler` that aborts with `code`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    kind: Callable[..., grpc.RpcMethodHandler[Any, Any]]
    if handler.request_streaming and handler.response_streaming:
        kind = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        kind = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        kind = grpc.unary_stream_rpc_method_handler
    else:
        kind = grpc.unary_unary_rpc_method_handler
    return kind(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
