"""One MultiplexGenerate stream to a core and the requests open on it (generate_service.proto).

The core sends one message per engine step with the news of every request on the stream: plain
decode steps in columns (`steps`), whole messages and terminal statuses in `events`, a
request's steps before its events. The reader hands each request its part as deltas
(gateways.common.core_call) and then tells each request with news once, so one core message
makes at most one write per request; after the message, the client's `after_news` callbacks run
(a WebSocket's one frame per step).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any, cast

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_call import CoreCall
from gateways.common.status import GatewayError
from oteltrace import traceparent_of

if TYPE_CHECKING:
    from gateways.common.core_client import CoreClient

log = logging.getLogger(__name__)

#: The most starts one MultiplexGenerateRequest may carry (generate_service.proto; the core ends
#: a stream that sends more with RESOURCE_EXHAUSTED); a burst goes out in several messages.
MAX_STARTS_PER_MESSAGE = 256


class MultiplexedStream:
    """One MultiplexGenerate stream and the requests open on it.

    Args:
        client: the owner (its retries, fallback and delivery hooks).
        stub: the stub of the channel the stream opens on.
        metadata: the stream's metadata (the session channel's hash header).
    """

    def __init__(self, client: CoreClient, stub: Any, metadata: tuple[tuple[str, str], ...] = ()):
        self.client = client
        self.call = cast(Any, stub.MultiplexGenerate(metadata=(*client.metadata, *metadata) or None))
        self.open: dict[int, CoreCall] = {}
        self.broken = False
        self.retired = False  # takes no new request; half-closed once `open` is empty
        self.expires = float("inf")  # monotonic time after which it takes no new request
        self.core: str | None = None  # the core's address when the client chose it (--routing prefix)
        self._ids = itertools.count(1)
        self._starts: list[spb.MultiplexStart] = []
        self._cancels: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def start(self, call: CoreCall) -> None:
        """Send `call`'s request on this stream."""
        rid = next(self._ids)
        call._cancel = lambda: self._cancel(rid)
        self.open[rid] = call
        start = spb.MultiplexStart(id=rid, steps=call.steps)
        start.request.CopyFrom(call.request)
        if call.span is not None:
            start.request.trace_context = traceparent_of(call.span)
        self._starts.append(start)
        self._wake()

    def retire(self) -> None:
        """Take no new request; end the stream once the open ones ended."""
        self.retired = True
        self._wake()

    def _cancel(self, rid: int) -> None:
        if self.open.pop(rid, None) is not None and not self.broken:
            self._cancels.append(rid)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _write(self) -> None:
        """Send what waits to be started or cancelled, as one message each time; half-close a
        retired stream once nothing is open."""
        try:
            while True:
                if not (self._starts or self._cancels):
                    if self.retired and not self.open:
                        await self.call.done_writing()
                        return
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                    continue
                starts, self._starts = self._starts[:MAX_STARTS_PER_MESSAGE], self._starts[MAX_STARTS_PER_MESSAGE:]
                msg = spb.MultiplexGenerateRequest(starts=starts, cancels=self._cancels)
                self._cancels = []
                await self.call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream failed: the reader reports it to the requests
            log.debug("multiplexed stream write failed: %s", e)

    def _refused(self, call: CoreCall, error: GatewayError | None) -> None:
        """A request's end before it started: resent elsewhere when it was refused."""
        if error is not None and self.client._retry(call, error, self):
            return
        call._news((), True, error)

    def _deliver(self, msg: spb.MultiplexGenerateResponse) -> None:
        """Hand every request its news of one core message: its steps, then its events (the
        order the core keeps per request), then tell each once. No call outlives this frame,
        so an ended request is freed at once, not when the stream's next message comes."""
        open_calls = self.open
        told: dict[int, CoreCall] = {}
        if msg.HasField("steps"):
            steps = msg.steps
            for rid, text, token_id, logprob in zip(
                steps.ids, steps.texts, steps.token_ids, steps.logprobs, strict=True
            ):
                call = open_calls.get(rid)
                if call is not None:  # else cancelled by the gateway: late news
                    call._add_step((text, token_id, None if logprob != logprob else logprob))  # NaN: not asked
                    told[rid] = call
        for ev in msg.events:
            rid = ev.id
            call = open_calls.get(rid)
            if call is None:
                continue
            if not ev.HasField("status"):
                call._add(ev.responses)
                told[rid] = call
                continue
            del open_calls[rid]
            st = ev.status
            err = GatewayError.from_status(st.code, st.message, st.details) if st.code else None
            if err is not None and not ev.responses and not call.started:
                told.pop(rid, None)
                self._refused(call, err)
                continue
            call._add(ev.responses)
            call._end(err)
            told[rid] = call
        for call in told.values():
            try:
                call._notify()
            except Exception:
                log.exception("request %s: rendering failed", call.request.request_id)
                call.cancel()

    async def _read(self) -> None:
        """Hand every message's news to its requests; at the stream's end, end the requests
        left."""
        error = GatewayError(grpc.StatusCode.UNAVAILABLE, "The model server closed the connection; retry.")
        unimplemented = False
        client = self.client
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                client._delivering = True
                try:
                    self._deliver(msg)
                finally:
                    client._delivered()
                if self.retired and not self.open:
                    self._wake()
        except grpc.RpcError as e:
            unimplemented = e.code() is grpc.StatusCode.UNIMPLEMENTED
            error = GatewayError.from_rpc_error(e)
        except asyncio.CancelledError:
            error = GatewayError(grpc.StatusCode.UNAVAILABLE, "The gateway is shutting down.")
            raise
        finally:
            self.broken = True
            self._writer.cancel()
            client._closed(self)
            calls, self.open = list(self.open.values()), {}
            for call in calls:
                if unimplemented:
                    client._fallback(call)
                elif call.started:
                    call._news((), True, error)
                else:
                    self._refused(call, error)
