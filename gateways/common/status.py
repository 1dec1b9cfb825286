"""gRPC status -> HTTP status, and the gateway-side error type.

The table is grpc-gateway's `HTTPStatusFromCode` (runtime/errors.go) except for
CANCELLED (see below); a schema that needs other numbers (LMI answers RESOURCE_EXHAUSTED with
503, as DJL does) passes overrides to `GatewayError.http_status`. `GatewayError.from_rpc_error`
decodes the core's google.rpc details: the field named by BadRequest / ErrorInfo metadata
"param", and the ErrorInfo reason; `GatewayError.from_status` the same details of a status the
core sends in-band (MultiplexGenerate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    # A gateway renders CANCELLED only when the core cancelled the call (draining, shutdown): the
    # gateway's own cancel comes after its response, so this is the server's failure, not 499.
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}


class GatewayError(Exception):
    """An error to render in a schema's own error shape.

    Attributes:
        code: gRPC status code (the source of the HTTP status).
        message: sentence for the client.
        param: the offending field as the core names it (e.g. "sampling.top_p"), or a schema
            field name when the gateway itself found the problem.
        reason: machine-readable reason (google.rpc.ErrorInfo.reason), if any.
        retry_after: seconds after which a retry may succeed (google.rpc.RetryInfo: a tenant
            over its limits), or None; `retry_headers` turns it into Retry-After.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        param: str | None = None,
        reason: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code
        self.message = message
        self.param = param
        # Every error carries a machine-readable reason: the core's, else the status code's name.
        self.reason = reason or code.name

    def http_status(self, overrides: Mapping[grpc.StatusCode, int] | None = None) -> int:
        """The HTTP status for this error (schema overrides first, then GRPC_TO_HTTP)."""
        if overrides and self.code in overrides:
            return overrides[self.code]
        return GRPC_TO_HTTP.get(self.code, 500)

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> GatewayError:
        """A bad request found by the gateway itself (JSON shape or type)."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message, param=param, reason="INVALID_ARGUMENT")

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> GatewayError:
        """Decode a failed call's status, message and google.rpc details."""
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        message = error.details() if callable(getattr(error, "details", None)) else str(error)
        details: Sequence[Any] = ()
        try:
            # grpc.aio's errors carry the Call methods from_call reads (code, details, trailers).
            status = rpc_status.from_call(cast(grpc.Call, error))
        except Exception:  # malformed or missing details: keep code and message
            status = None
        if status is not None:
            details = status.details
        return cls._decode(code, message or "", details)

    @classmethod
    def from_status(cls, code: int, message: str, details: Sequence[Any]) -> GatewayError:
        """Decode a status sent in-band (a MultiplexGenerate request's end: the fields of a
        google.rpc.Status), as `from_rpc_error` decodes a call's."""
        return cls._decode(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, details)

    @classmethod
    def _decode(cls, code: grpc.StatusCode, message: str, details: Sequence[Any]) -> GatewayError:
        # details: google.protobuf.Any messages
        param = reason = None
        retry_after: float | None = None
        for detail in details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or reason
                param = info.metadata.get("param") or param
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                if bad.field_violations:
                    param = bad.field_violations[0].field
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
        if reason is None and code in TRANSPORT_ERRORS:
            # Not the core's own error but grpc's (the connection broke, the server stopped):
            # its wording ("Stream removed", "Cancelling all calls") means nothing to a client.
            message, reason = transport_error(code, message)
        if code is grpc.StatusCode.UNAUTHENTICATED:  # the gateway's own key, not the client's
            code = grpc.StatusCode.INTERNAL
            message = "The model server refused this gateway's API key (--core-api-key)."
        return cls(code, message or code.name, param=param, reason=reason, retry_after=retry_after)


def retry_headers(err: GatewayError) -> dict[str, str]:
    """`Retry-After` (whole seconds, at least 1; RFC 9110 section 10.2.3) for an error that
    carries the core's retry delay; {} for others (which get --retry-after-seconds on 429 and
    503: gateways.common.app)."""
    if err.retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after)))}


def transport_error(code: grpc.StatusCode, message: str) -> tuple[str, str]:
    """The documented sentence and reason for a status of a code that grpc itself produces
    (TRANSPORT_ERRORS) without the core's ErrorInfo; `message` (grpc's text) only tells an
    unreachable core apart.

    Returns:
        (sentence, reason), e.g. ("The model server cannot be reached.", "CORE_UNREACHABLE").
    """
    if code is grpc.StatusCode.UNAVAILABLE and "connect" in message.lower():
        return CORE_UNREACHABLE, "CORE_UNREACHABLE"
    return TRANSPORT_ERRORS.get(code, (message, code.name))


CORE_UNREACHABLE = "The model server cannot be reached."
CORE_CANCELLED = "The model server cancelled the request before it finished; retry it."
DEADLINE_PASSED = "The request did not finish within the gateway's time limit (--request-timeout)."

#: grpc's own statuses -> the sentence and reason a client sees (docs/*.md "Errors").
TRANSPORT_ERRORS: dict[grpc.StatusCode, tuple[str, str]] = {
    grpc.StatusCode.UNAVAILABLE: ("The model server closed the connection; retry.", "CORE_UNAVAILABLE"),
    grpc.StatusCode.CANCELLED: (CORE_CANCELLED, "CANCELLED"),
    grpc.StatusCode.UNKNOWN: ("The model server closed the connection; retry.", "CORE_UNAVAILABLE"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (DEADLINE_PASSED, "DEADLINE_EXCEEDED"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        "The request or response is larger than the gRPC message size limit.",
        "MESSAGE_TOO_LARGE",
    ),
    grpc.StatusCode.UNIMPLEMENTED: ("The model server does not implement this call.", "UNIMPLEMENTED"),
}


#: google.rpc.Code numbers -> grpc.StatusCode.
_CODES = {c.value[0]: c for c in grpc.StatusCode}
