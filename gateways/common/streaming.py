"""The I/O of every gateway's Generate calls: the first-message rule, the relay of streamed HTTP
responses, and the merging of several calls' streams.

An HTTP status can only be chosen before the first byte is sent (aiohttp's `prepare()`), so a
streaming route pulls the first delta of the Generate stream before preparing its response:
anything that fails before it (validation, unknown model, queue full, core down) is a proper
error status; anything after it must be rendered in-band. The core sends its QUEUED message
right after validation and admission, so the first delta arrives at once (docs/architecture.md,
Errors).

A Generate stream is complete only when its last message is the final one, the one carrying
`usage` (generate_service.proto); the CoreCall itself ends one that is not with INTERNAL
(gateways.common.core_call.incomplete_stream), for every gateway.

Rendering stays pure and per schema (each translate module): one renderer per schema takes each
delta, a whole message or a plain decode step (gateways.common.core_call); `relay` writes its
bytes through the ResponseWriter (gateways.common.writer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar, cast

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_call import CoreCall, Delta
from gateways.common.core_client import CONFIG_KEY
from gateways.common.metrics import client_gone, client_too_slow
from gateways.common.status import GatewayError
from gateways.common.writer import ClientTooSlow, ResponseWriter

log = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Headers of every streamed response: no caching, and no buffering by proxies such as nginx,
#: so each record reaches the client as it is written.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

#: A renderer of a CoreStream's deltas (what `relay` renders for one); a prebuilt alias, as
#: `cast` evaluates a subscripted type on every call.
_RenderDelta = Callable[[Delta], bytes]


class Stream(Protocol[T_co]):
    """What `relay` answers with: items to render, and a way to cancel the calls behind them."""

    def __aiter__(self) -> AsyncIterator[T_co]:
        """The items; raises GatewayError for a failure after the first one."""
        ...

    def cancel(self) -> None:
        """Cancel the Generate calls behind the stream (no-op for ended ones)."""


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


def finish_word(finish_reason: int, words: Mapping[int, str]) -> str | None:
    """A sequence's finish reason in a schema's words (its finish-reason table).

    Returns:
        The word; None while the sequence is unfinished (FINISH_REASON_UNSPECIFIED).

    Raises:
        GatewayError: a finish reason the table has no word for (CANCELLED and ERROR in
            schemas without them): see `sequence_error`.
    """
    if not finish_reason:
        return None
    word = words.get(finish_reason)
    if word is None:
        raise sequence_error(finish_reason) or GatewayError(
            grpc.StatusCode.INTERNAL, f"The model server sent an unknown finish reason {finish_reason}."
        )
    return word


class CoreStream:
    """A Generate request with its first delta already received.

    Usage::

        stream = await CoreStream.open(client.generate(req))   # GatewayError: render before stream
        try:
            async for delta in stream:                          # GatewayError: render in-band
                ...
        finally:
            stream.cancel()

    or, without a wake-up per delta, `stream.listen(fn)`: `fn()` runs as news arrive (see
    `relay`), and `call.take()` / `call.ended` / `call.error` tell what they are.

    Iteration raises a GatewayError for a request that fails (the core's status, decoded, or
    `incomplete_stream` for one that ended without its final message).
    """

    def __init__(self, call: CoreCall):
        self.call = call

    @classmethod
    async def open(cls, call: CoreCall) -> CoreStream:
        """Wait for the first delta.

        Raises:
            GatewayError: the request failed before its first message (it is cancelled).
        """
        try:
            await call.wait()
        except BaseException:
            call.cancel()
            raise
        if call.ended and call.error is not None and not call.pending():
            raise call.error
        return cls(call)

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener()` synchronously as news arrive (now, if some wait already)."""
        self.call.listen(listener)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        call = self.call
        while True:
            for delta in call.take():
                yield delta
            if call.ended and not call.pending():
                break
            await call.wait()
        if call.error is not None:
            raise call.error

    def cancel(self) -> None:
        """Cancel the request (no-op when it already ended); the core then aborts it."""
        self.call.cancel()


async def collect(call: CoreCall) -> list[spb.GenerateResponse]:
    """All messages of a call sent without `steps` (for non-streaming routes); the last one is
    the final message.

    Raises:
        GatewayError: the call failed or ended without its final message.
    """
    stream = await CoreStream.open(call)
    try:
        return [cast(spb.GenerateResponse, msg) async for msg in stream]
    finally:
        stream.cancel()


async def collect_all(calls: Sequence[CoreCall]) -> list[list[spb.GenerateResponse]]:
    """`collect` of several calls at once, in their order; the first failure cancels the others.

    Raises:
        GatewayError: the first call that failed.
    """
    tasks = [asyncio.create_task(collect(call)) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_all(calls: Sequence[CoreCall]) -> list[CoreStream]:
    """`CoreStream.open` of several calls at once, in their order; on a failure the opened ones
    are cancelled.

    Raises:
        GatewayError: the first call that failed before its first message.
    """
    tasks = [asyncio.create_task(CoreStream.open(call)) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, CoreStream):
                outcome.cancel()
        raise


class FanIn(Generic[T]):
    """A queue that several producers fill and one consumer empties a batch at a time.

    A batch is the next item (waited for) and every item already queued behind it: the consumer
    sends what arrived meanwhile as one frame, and no item waits for one that is not ready yet.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue()

    def put_nowait(self, item: T) -> None:
        """Queue an item."""
        self._queue.put_nowait(item)

    async def batch(self) -> list[T]:
        """The next item and every item ready behind it, in order."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


class _End:
    """A stream's end in a MergedStreams queue."""


class MergedStreams(Generic[T]):
    """Several opened Generate calls read at once, merged by arrival.

    Each iteration gives `(index, each(message))` for every message that arrived since the last
    one, in arrival order (index: the stream's position in `streams`). It ends when every stream
    has ended; the first failure (a stream's GatewayError, or one raised by `each`) is raised
    after the items that arrived before it.

    Args:
        streams: opened calls sent without `steps` (`open_all`), so their deltas are messages.
        each: the per-message translation (pure; may raise GatewayError).
    """

    def __init__(self, streams: Sequence[CoreStream], each: Callable[[spb.GenerateResponse], T]) -> None:
        self.streams = list(streams)
        self._each = each

    async def __aiter__(self) -> AsyncIterator[list[tuple[int, T]]]:
        queue: FanIn[tuple[int, T | GatewayError | _End]] = FanIn()
        pumps = [asyncio.create_task(self._pump(i, s, queue)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(pumps)
            while remaining:
                items: list[tuple[int, T]] = []
                error: GatewayError | None = None
                for i, item in await queue.batch():
                    if isinstance(item, _End):
                        remaining -= 1
                    elif isinstance(item, GatewayError):
                        error = error or item
                    else:
                        items.append((i, item))
                if items:
                    yield items
                if error is not None:
                    raise error
        finally:
            for task in pumps:
                task.cancel()

    async def _pump(self, index: int, stream: CoreStream, queue: FanIn[tuple[int, T | GatewayError | _End]]) -> None:
        try:
            async for msg in stream:
                queue.put_nowait((index, self._each(cast(spb.GenerateResponse, msg))))
        except GatewayError as e:
            queue.put_nowait((index, e))
            return
        queue.put_nowait((index, _End()))

    def cancel(self) -> None:
        """Cancel every call."""
        for stream in self.streams:
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
    # The header as aiohttp's content_type and charset setters would write it, without their
    # parse-and-rebuild per response.
    value = f"{content_type}; charset={charset}" if charset else content_type
    return web.StreamResponse(headers={**STREAM_HEADERS, **(headers or {}), "Content-Type": value})


async def relay(
    request: web.Request,
    stream: Stream[T],
    render: Callable[[T], bytes],
    render_error: Callable[[GatewayError], bytes],
    *,
    content_type: str,
    charset: str | None = None,
    headers: Mapping[str, str] | None = None,
    end: Callable[[], bytes] | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
    request_id: str = "",
) -> web.StreamResponse:
    """Answer with an open stream: one write per core message (or batch), merged writes while
    the client reads slower.

    A CoreStream is relayed without a task wake-up per delta: its listener renders the deltas
    of each core message (an engine step) and writes them at once, from the gateway's reader of
    the core's stream; this handler only waits for the end, or drains a paused connection.
    Other streams (MergedStreams) are iterated.

    Args:
        request: the request answered.
        stream: the opened request(s) (`CoreStream.open` succeeded, so the status is 200): a
            CoreStream (items: its deltas) or MergedStreams (items: batches).
        render: the framed bytes for one item (b"" for none, e.g. lifecycle-only messages); a
            GatewayError it raises ends the stream in-band, as a failed request does.
        render_error: the framed in-band error that ends a stream failing after it started
            (everything the schema sends last, e.g. OpenAI's error event and `data: [DONE]`).
        content_type, charset, headers: see `stream_response`.
        end: the framed bytes after the last item of a complete stream (e.g. a usage chunk,
            `data: [DONE]`), if any.
        finish: awaited after the last item of a complete stream, before `end` (e.g. storing
            the finished response, which `end` then announces); a GatewayError it raises ends
            the stream in-band instead of `end`.
        request_id: for the log.

    Returns:
        The response, ended unless the client went away or read too slowly (more than
        --max-buffered-bytes waiting for it, or nothing taken for --write-timeout seconds: the
        connection is aborted). The requests are cancelled in all cases (also on the
        handler's cancellation or a failed write), so the core aborts the engine requests.
    """
    resp = stream_response(content_type, charset=charset, headers=headers)
    try:
        await resp.prepare(request)
        config = request.app.get(CONFIG_KEY)
        out = ResponseWriter(
            request,
            max_waiting_bytes=config.max_buffered_bytes if config else 0,
            write_timeout=config.write_timeout if config else 0.0,
        )
        pushed: object = stream  # a Stream[T] whose T is Delta
        if isinstance(pushed, CoreStream):
            if finish is None:
                await _relay_pushed(pushed, out, cast(_RenderDelta, render), render_error, end)
            elif await _relay_pushed(pushed, out, cast(_RenderDelta, render), render_error, None):
                await _finish(out, finish, end, render_error, request_id)
        else:
            try:
                async for item in stream:
                    if data := render(item):
                        out.write(data)
                        await out.drain()
                if finish is not None:
                    await finish()
                if end is not None and (data := end()):
                    out.write(data)
            except GatewayError as e:
                log.warning("request %s failed mid-stream: %s %s", request_id, e.code.name, e.message)
                out.write(render_error(e))
        await out.drain()
        await resp.write_eof()
    except ClientTooSlow as e:
        log.warning("request %s cancelled: %s", request_id, e)
        client_too_slow(request)
    except ConnectionResetError:
        log.info("request %s: the client went away", request_id)
        client_gone(request)
    finally:
        stream.cancel()
    return resp


async def _finish(
    out: ResponseWriter,
    finish: Callable[[], Awaitable[None]],
    end: Callable[[], bytes] | None,
    render_error: Callable[[GatewayError], bytes],
    request_id: str,
) -> None:
    """`finish`, then `end`'s bytes, after a complete pushed stream (see relay)."""
    try:
        await finish()
        data = end() if end is not None else b""
    except GatewayError as e:
        log.warning("request %s failed mid-stream: %s %s", request_id, e.code.name, e.message)
        data = render_error(e)
    if data:
        out.write(data)


async def _relay_pushed(
    stream: CoreStream,
    out: ResponseWriter,
    render: _RenderDelta,
    render_error: Callable[[GatewayError], bytes],
    end: Callable[[], bytes] | None,
) -> bool:
    """Relay a CoreStream from its listener; True when it ended complete (not in-band)."""
    call = stream.call
    done = complete = False
    gone: ConnectionResetError | None = None
    wake: asyncio.Future[None] | None = None

    def on_news() -> None:
        nonlocal done, gone, complete
        if done:  # ended in-band already: news until the call is cancelled are dropped
            return
        parts: list[bytes] = []
        try:
            for delta in call.take():
                if data := render(delta):
                    parts.append(data)
            if call.ended:
                if call.error is not None:
                    raise call.error
                if end is not None:
                    parts.append(end())
                done = complete = True
        except GatewayError as e:
            log.warning("request %s failed mid-stream: %s %s", call.request.request_id, e.code.name, e.message)
            parts.append(render_error(e))
            done = True
        except Exception:  # a rendering bug: end this response in-band, never the reader
            log.exception("request %s: rendering failed", call.request.request_id)
            parts.append(render_error(GatewayError(grpc.StatusCode.INTERNAL, "Internal error in the gateway.")))
            done = True
        if parts:
            try:
                out.write(parts[0] if len(parts) == 1 else b"".join(parts))
            except ConnectionResetError as e:
                gone, done = e, True
        if (done or out.waiting) and wake is not None and not wake.done():
            wake.set_result(None)

    stream.listen(on_news)
    while not done or out.waiting:
        if out.waiting:
            try:
                await out.drain()
            except ConnectionResetError:
                raise gone or ConnectionResetError("the client closed the connection") from None
            continue
        wake = asyncio.get_running_loop().create_future()
        await wake
    if gone is not None:
        # The error's traceback holds on_news's frame, and so this cell: left set, the cell and
        # the error would keep the request's objects in a cycle for the collector.
        try:
            raise gone
        finally:
            gone = None
    return complete
