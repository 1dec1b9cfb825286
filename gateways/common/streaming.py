"""The first-message rule for streaming routes.

An HTTP status can only be chosen before the first byte is sent (aiohttp's `prepare()`), so a
streaming route pulls the first message of the Generate stream before preparing its response:
anything that fails before it (validation, unknown model, queue full, core down) is a proper
error status; anything after it must be rendered in-band. The core sends its QUEUED message
right after validation and admission, so the first message arrives at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError


class CoreStream:
    """A Generate call with its first message already received.

    Usage::

        stream = await CoreStream.open(client.generate(req))   # GatewayError: render before stream
        try:
            async for msg in stream:                            # GatewayError: render in-band
                ...
        finally:
            stream.cancel()
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, first: spb.GenerateResponse | None):
        self.call = call
        self._first = first

    @classmethod
    async def open(cls, call: grpc.aio.UnaryStreamCall) -> CoreStream:
        """Wait for the first message.

        Raises:
            GatewayError: the call failed before its first message (the call is cancelled).
        """
        try:
            first = await call.read()
        except grpc.RpcError as e:
            call.cancel()
            raise GatewayError.from_rpc_error(e) from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            first = None
        return cls(call, first)

    async def __aiter__(self) -> AsyncIterator[spb.GenerateResponse]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg
        except grpc.RpcError as e:
            raise GatewayError.from_rpc_error(e) from None

    def cancel(self) -> None:
        """Cancel the call (no-op when it already ended); the core then aborts the request."""
        self.call.cancel()


async def collect(call: grpc.aio.UnaryStreamCall) -> list[spb.GenerateResponse]:
    """All messages of a call (for non-streaming routes).

    Raises:
        GatewayError: the call failed.
    """
    stream = await CoreStream.open(call)
    try:
        return [msg async for msg in stream]
    finally:
        stream.cancel()
