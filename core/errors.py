"""Core error types and their gRPC status rendering.

Every failure the core reports to a client is a CoreError subclass. `to_status()` turns it
into a gRPC status with machine-readable details: `google.rpc.ErrorInfo` (reason, domain
"trellis", metadata "param") and, for field errors, `google.rpc.BadRequest` naming the field by
its GenerateRequest path (e.g. "sampling.top_p"); a refusal that knows when to come back adds
`google.rpc.RetryInfo` (a per-tenant limit: core.tenants). Gateways decode these details once
(GatewayError) and name the client's own field through their schema's field table.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "trellis"


class CoreError(Exception):
    """Base of client-visible core errors.

    Attributes:
        code: gRPC status code.
        reason: UPPER_SNAKE machine-readable reason (ErrorInfo.reason).
        field: GenerateRequest field path the error is about, or None.
        retry_delay: seconds after which a retry may succeed (google.rpc.RetryInfo), or None.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def __init__(
        self, message: str, *, field: str | None = None, reason: str | None = None, retry_delay: float | None = None
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_delay = retry_delay
        if reason is not None:
            self.reason = reason

    def to_status(self) -> grpc.Status:
        """The gRPC status with ErrorInfo (and BadRequest when a field is named) details."""
        return rpc_status.to_status(self.to_rpc_status())

    def to_rpc_status(self) -> status_pb2.Status:
        """The same status as a google.rpc.Status message (MultiplexGenerate sends it in-band)."""
        details = []
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN)
        if self.field:
            info.metadata["param"] = self.field
        details.append(_pack(info))
        if self.field:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.message)
                ]
            )
            details.append(_pack(bad))
        if self.retry_delay is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(round(self.retry_delay * 1e9))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        return status_pb2.Status(code=_CODE_NUMBERS[self.code], message=self.message, details=details)


class InvalidArgument(CoreError):
    """A field value is out of range, contradicts another, or cannot be honoured (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class ContextLengthExceeded(InvalidArgument):
    """Prompt plus max_new_tokens does not fit the model's context (INVALID_ARGUMENT)."""

    reason = "CONTEXT_LENGTH_EXCEEDED"


class ModelNotFound(CoreError):
    """The request names a model the core does not serve (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "MODEL_NOT_FOUND"


class AdapterNotFound(CoreError):
    """The request or call names a LoRA adapter this core has not registered, or a path that
    holds no adapter (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "ADAPTER_NOT_FOUND"


class AdapterExists(CoreError):
    """LoadAdapter with a name already registered (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ADAPTER_EXISTS"


class ManagementDisabled(CoreError):
    """LoadAdapter or UnloadAdapter on a core started without --enable-lora-management
    (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "LORA_MANAGEMENT_DISABLED"


class SessionBusy(CoreError):
    """Another running request holds the same session_id (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_BUSY"


class Overloaded(CoreError):
    """The engine's queue is full, or a tenant is over its limits (reason TENANT_LIMIT, with a
    retry delay: core.tenants) (RESOURCE_EXHAUSTED); retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "QUEUE_FULL"


class SlowReader(Overloaded):
    """The client read its stream too slowly: the request was cancelled rather than its
    output kept without bound (RESOURCE_EXHAUSTED; core.multiplex.StreamBounds)."""

    reason = "SLOW_READER"


class NotReady(CoreError):
    """The core is starting or draining (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "NOT_READY"


class EngineFailure(CoreError):
    """The engine failed this request (INTERNAL)."""

    code = grpc.StatusCode.INTERNAL
    reason = "ENGINE_FAILURE"


class EngineDead(EngineFailure):
    """The engine can serve no more requests; health flips to NOT_SERVING (INTERNAL)."""

    reason = "ENGINE_DEAD"


_CODE_NUMBERS = {c: getattr(code_pb2, c.name) for c in grpc.StatusCode}


def _pack(msg: Message) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a
