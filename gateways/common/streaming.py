"""The first-message rule for streaming routes, and the relay loop every streaming route shares.

An HTTP status can only be chosen before the first byte is sent (aiohttp's `prepare()`), so a
streaming route pulls the first message of the Generate stream before preparing its response:
anything that fails before it (validation, unknown model, queue full, core down) is a proper
error status; anything after it must be rendered in-band. The core sends its QUEUED message
right after validation and admission, so the first message arrives at once (DESIGN.md "Errors,
per schema").

A Generate stream is complete only when its last message is the final one, the one carrying
`usage` (DESIGN.md "The gRPC contract"). `CoreStream` checks that once, for every gateway: a
call that ends with an OK status but without its final message raises INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError

log = logging.getLogger(__name__)

#: Headers of every streamed response: no caching, and no buffering by proxies such as nginx,
#: so each record reaches the client as it is written.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def incomplete_stream() -> GatewayError:
    """The error for a Generate call that ended without its final message (INTERNAL)."""
    return GatewayError(
        grpc.StatusCode.INTERNAL,
        "The model server ended the response before it finished.",
        reason="INCOMPLETE_STREAM",
    )


def sequence_error(finish_reason: int) -> GatewayError | None:
    """The error for a sequence that ended without a result, for schemas that have no finish
    reason for it (LMI, WebSocket); None for every other finish reason.

    FINISH_REASON_CANCELLED (the core cancelled the request, e.g. while draining) is
    UNAVAILABLE, so the client retries; FINISH_REASON_ERROR (the engine failed the sequence; the
    call then also ends with a non-OK status) is INTERNAL.
    """
    if finish_reason == pb.FINISH_REASON_CANCELLED:
        return GatewayError(
            grpc.StatusCode.UNAVAILABLE, "The model server cancelled the request before it finished; retry it."
        )
    if finish_reason == pb.FINISH_REASON_ERROR:
        return GatewayError(grpc.StatusCode.INTERNAL, "The model server failed while generating.")
    return None


class CoreStream:
    """A Generate call with its first message already received.

    Usage::

        stream = await CoreStream.open(client.generate(req))   # GatewayError: render before stream
        try:
            async for msg in stream:                            # GatewayError: render in-band
                ...
        finally:
            stream.cancel()

    Iteration raises GatewayError for a call that fails (the core's status, decoded) or that ends
    without its final message (`incomplete_stream`, INTERNAL).
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
        last = self._first
        if last is None:
            raise incomplete_stream()
        self._first = None
        yield last
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                last = msg
                yield msg
        except grpc.RpcError as e:
            raise GatewayError.from_rpc_error(e) from None
        # Only the final message carries usage, and it is the last one.
        if not last.HasField("usage"):
            raise incomplete_stream()

    def cancel(self) -> None:
        """Cancel the call (no-op when it already ended); the core then aborts the request."""
        self.call.cancel()


async def collect(call: grpc.aio.UnaryStreamCall) -> list[spb.GenerateResponse]:
    """All messages of a call (for non-streaming routes); the last one is the final message.

    Raises:
        GatewayError: the call failed or ended without its final message.
    """
    stream = await CoreStream.open(call)
    try:
        return [msg async for msg in stream]
    finally:
        stream.cancel()


def stream_response(
    content_type: str, *, charset: str | None = None, headers: Mapping[str, str] | None = None
) -> web.StreamResponse:
    """An unprepared 200 streamed response with STREAM_HEADERS; `prepare()` commits its status.

    Args:
        content_type: e.g. "text/event-stream" or "application/jsonlines".
        charset: added to Content-Type when given (Triton's "text/event-stream; charset=utf-8").
        headers: more headers (e.g. x-request-id).
    """
    resp = web.StreamResponse(headers={**STREAM_HEADERS, **headers} if headers else STREAM_HEADERS)
    resp.content_type = content_type
    if charset:
        resp.charset = charset
    return resp


async def relay(
    request: web.Request,
    stream: CoreStream,
    render: Callable[[spb.GenerateResponse], bytes],
    render_error: Callable[[GatewayError], bytes],
    *,
    content_type: str,
    charset: str | None = None,
    headers: Mapping[str, str] | None = None,
    end: Callable[[], bytes] | None = None,
    request_id: str = "",
) -> web.StreamResponse:
    """Answer with an open Generate stream: one write per message, as it arrives.

    Args:
        request: the request answered.
        stream: the opened call (`CoreStream.open` succeeded, so the status is 200).
        render: the framed bytes for one message (b"" for none, e.g. lifecycle-only messages).
        render_error: the framed in-band error that ends a stream failing after it started
            (everything the schema sends last, e.g. OpenAI's error event and `data: [DONE]`).
        content_type, charset, headers: see `stream_response`.
        end: the framed bytes after the last message of a complete stream (e.g. a usage chunk,
            `data: [DONE]`), if any.
        request_id: for the log.

    Returns:
        The response, ended unless the client went away. The call is cancelled in all cases
        (also on the handler's cancellation or a failed write), so the core aborts the engine
        request.
    """
    resp = stream_response(content_type, charset=charset, headers=headers)
    try:
        await resp.prepare(request)
        try:
            async for msg in stream:
                data = render(msg)
                if data:
                    await resp.write(data)
            if end is not None and (data := end()):
                await resp.write(data)
        except GatewayError as e:
            log.warning("request %s failed mid-stream: %s %s", request_id, e.code.name, e.message)
            await resp.write(render_error(e))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("request %s: the client went away", request_id)
    finally:
        stream.cancel()
    return resp
