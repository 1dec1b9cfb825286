"""Registers GenerateService on a grpc.aio server with request parsing that survives bad bytes.

grpc's generated `add_GenerateServiceServicer_to_server` parses each request with
`FromString`; a message that does not parse (corrupt wire bytes, invalid UTF-8 in a string
field: upb raises google.protobuf.message.DecodeError) then fails inside grpc, which logs an
ERROR traceback and answers UNKNOWN. Here the parser hands such a request to the servicer as a
`Malformed` value instead, and the servicer answers INVALID_ARGUMENT with one log line
(`Malformed.error`). The handler table is built from the service descriptor, so it follows the
.proto as the generated one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from trellis.generate.v1 import generate_service_pb2 as spb

from core.errors import InvalidArgument

SERVICE = spb.DESCRIPTOR.services_by_name["GenerateService"]

_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class Malformed:
    """A request message that did not parse (what the servicer receives instead of it).

    Attributes:
        size: its length in bytes.
    """

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def error(self, method: str) -> InvalidArgument:
        """The error to answer with (INVALID_ARGUMENT, reason MALFORMED_REQUEST)."""
        return InvalidArgument(
            f"The {method} request ({self.size} bytes) is not a valid protobuf message of its type "
            "(corrupt bytes, or invalid UTF-8 in a string field).",
            reason="MALFORMED_REQUEST",
        )


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    parse = message_class.FromString

    def parse_or_malformed(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError:
            return Malformed(len(raw))

    return parse_or_malformed


def add_generate_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Register `servicer`'s GenerateService methods on `server` (as the generated
    add_GenerateServiceServicer_to_server does), with `Malformed` for unparsable requests."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
