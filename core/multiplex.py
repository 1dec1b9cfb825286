"""The consumers of pipeline Jobs that the servicer streams from: one Generate call
(`CallOutput`), or a gateway's MultiplexGenerate stream (`MultiplexSession`).

Both are fed synchronously by the pipeline while an engine step is delivered, and only wake
their writer coroutine; the writer runs once the whole step was processed. A MultiplexSession
therefore sends one message per engine step carrying the news of every request on the stream,
built in place as protobuf (`core.convert.fill_response`) with the plain decode steps of
requests started with `steps` in columns (Steps), and a Generate call one message per step.
While a write is in flight (HTTP/2 flow control: the reader is slower than the engine), what
arrives meanwhile waits and goes out together: in the next MultiplexGenerateResponse, or merged
into as few GenerateResponses as keep their meaning (`core.pipeline.merge_deltas`). Nothing is dropped or reordered.

What waits is bounded (`StreamBounds`): a stream whose reader falls more than
`max_queued` messages behind, or takes nothing for `timeout` seconds while news waits, has its
requests cancelled (the engine aborts them within a step) with RESOURCE_EXHAUSTED, reason
SLOW_READER: in-band, as each request's terminal status, on a MultiplexGenerate stream; as the
call's status on a Generate call, whose unsent messages are dropped. The requests are cancelled,
not paused: no engine can hold a running sequence without its batch slot, and a client that
stopped reading keeps it from everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb

from core import convert
from core.errors import CoreError, EngineFailure, InvalidArgument, NotReady, Overloaded, SlowReader
from core.pipeline import Job, RequestPipeline
from core.tracing import CoreTracing, RequestTrace
from core.types import GenerationRequest, ResponseDelta
from core.wire import Malformed

log = logging.getLogger(__name__)

#: Events and Steps entries per MultiplexGenerateResponse before another message is started,
#: so a stream far behind its reader never builds one message near the gRPC size limit.
MAX_EVENTS_PER_MESSAGE = 4096

_NAN = float("nan")

#: Starts in one MultiplexGenerateRequest (generate_service.proto): each is validated and
#: admitted on the event loop, so one message must not hold it for long.
MAX_STARTS_PER_MESSAGE = 256


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """How far a stream's reader may fall behind before its requests are cancelled with
    SLOW_READER (see the module docstring).

    Attributes:
        max_queued: messages waiting to be written, per stream: GenerateResponses (and, on a
            MultiplexGenerate stream, Steps entries) produced and not yet handed to gRPC
            (--max-queued-messages-per-stream). One more cancels the stream's requests.
        timeout: seconds one write may stay in flight (the client's HTTP/2 window full) while
            the engine has news for the stream (--slow-reader-timeout); 0: no limit.
    """

    max_queued: int = 65536
    timeout: float = 30.0

    def exceeded(self, queued: int, writing_since: float | None, now: Callable[[], float]) -> SlowReader | None:
        """The error that cancels a stream with `queued` messages waiting and a write in flight
        since `writing_since` (loop time; None: none), or None while it is within bounds."""
        if queued > self.max_queued:
            return SlowReader(
                f"The client read too slowly: {queued} messages waited to be sent "
                f"(--max-queued-messages-per-stream {self.max_queued}); the request was cancelled."
            )
        if writing_since is not None and self.timeout > 0 and now() - writing_since > self.timeout:
            return SlowReader(
                f"The client took no message for {self.timeout:g} s while news waited "
                "(--slow-reader-timeout); the request was cancelled."
            )
        return None


class _Outgoing:
    """A MultiplexGenerateResponse being filled: its events in protobuf, its Steps as lists
    until it is sent (one `extend` per column costs less than an append each)."""

    __slots__ = ("add_event", "evented", "ids", "logprobs", "msg", "queued", "size", "texts", "token_ids")

    def __init__(self) -> None:
        self.msg = spb.MultiplexGenerateResponse()
        self.add_event: Callable[[], spb.MultiplexEvent] = self.msg.events.add
        self.size = 0  # events and Steps entries (MAX_EVENTS_PER_MESSAGE)
        self.queued = 0  # GenerateResponses and Steps entries (StreamBounds.max_queued)
        self.evented: set[int] = set()  # requests with an event here: their steps go in the next message
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []  # NaN: not asked for

    def message(self) -> spb.MultiplexGenerateResponse:
        """The message with its Steps filled in."""
        if self.ids:
            steps = self.msg.steps
            steps.ids.extend(self.ids)
            steps.texts.extend(self.texts)
            steps.token_ids.extend(self.token_ids)
            steps.logprobs.extend(self.logprobs)
        return self.msg


class CallOutput:
    """The consumer of one Generate call's Job: deltas wait here until the call's coroutine
    `take()`s them (one wake-up per engine step while it keeps up). Its jobs are started
    without `steps`, so every output arrives as deltas.

    Between one `take()` and the next the call writes what it took; deltas that wait beyond
    `bounds` cancel the job with SLOW_READER, and the waiting deltas are dropped (the call
    ends with that status after the message in flight)."""

    def __init__(self, bounds: StreamBounds | None = None) -> None:
        self.pending: list[ResponseDelta] = []
        self.ended = False
        self.error: CoreError | None = None
        self.bounds = bounds or StreamBounds()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._writing_since: float | None = None  # the loop time of the last take(), until the next

    def deliver(self, job: Job, deltas: list[ResponseDelta]) -> None:
        """Queue the job's next deltas (Consumer protocol); past the bounds, cancel the job
        (after this step's delivery: the job is still delivering)."""
        self.pending += deltas
        self._wake()
        if self.error is None:
            error = self.bounds.exceeded(len(self.pending), self._writing_since, self._loop.time)
            if error is not None:
                self.error = error
                self._loop.call_soon(self._give_up, job, error)

    def _give_up(self, job: Job, error: SlowReader) -> None:
        if job.done:  # it ended meanwhile (finish() set its own end)
            return
        job.cancel(error)
        job.p.metrics.slow_reader_cancels += 1
        self.pending = []
        self.ended = True
        self._wake()

    def deliver_step(self, job: Job, text: str, token_id: int, logprob: float | None) -> None:
        """Never called: Generate jobs are started without `steps` (Consumer protocol)."""
        raise AssertionError("a Generate call takes no steps")

    def finish(self, job: Job, error: CoreError | None) -> None:
        """The job ended (Consumer protocol)."""
        self.ended = True
        self.error = error
        self._wake()

    async def take(self) -> list[ResponseDelta]:
        """Every delta waiting, once there is one or the job ended ([] then). The caller
        writes them before it takes again (that time counts against `bounds.timeout`)."""
        self._writing_since = None
        while not self.pending and not self.ended:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self.pending = self.pending, []
        self._writing_since = self._loop.time()
        return batch

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Preparing:
    """Stands in `MultiplexSession.jobs` for a request whose prompt is being tokenized."""

    __slots__ = ("request_id", "task")

    def __init__(self, task: asyncio.Task[None], request_id: str):
        self.task = task
        self.request_id = request_id

    def cancel(self, error: CoreError | None = None) -> None:
        """Drop the preparation (`error`: as Job.cancel's; a request not started has no spans)."""
        self.task.cancel()


class MultiplexSession:
    """One MultiplexGenerate stream (see the RPC's comment in generate_service.proto).

    A reader task starts and cancels requests as the client's messages arrive; the handler's
    own coroutine writes. Each request runs as a pipeline Job whose deltas are rendered at once
    into the message being filled; the writer sends it once the engine step is processed (or,
    while a write is in flight, together with what comes next).

    Args:
        pipeline: the request pipeline.
        context: the call's servicer context (for writes).
        draining: the server drains already: every start is refused (the stream ends when the
            client ends it, or when the server stops).
        bounds: how far the reader may fall behind: beyond, every open request is cancelled
            with SLOW_READER, and so is every start until the reader catches up.
        caller: the identity of the stream's API key ("" without keys; it scopes sessions).
        tenant: the tenant every request of the stream is served for (the name of the call's
            API key), or None: each request's own `tenant` field.
        tracing: makes each request's spans, continuing its `trace_context` (core.tracing);
            None: tracing is off.

    Attributes:
        queued: GenerateResponses and Steps entries produced and not yet handed to gRPC.
    """

    def __init__(
        self,
        pipeline: RequestPipeline,
        context: grpc.aio.ServicerContext[spb.MultiplexGenerateRequest, spb.MultiplexGenerateResponse],
        *,
        draining: bool = False,
        bounds: StreamBounds | None = None,
        caller: str = "",
        tenant: str | None = None,
        tracing: CoreTracing | None = None,
    ):
        self.pipeline = pipeline
        self.tracing = tracing
        self.caller = caller
        self.tenant = tenant
        self.context = context
        self.draining = draining
        self.bounds = bounds or StreamBounds()
        self.queued = 0
        self._loop = asyncio.get_running_loop()
        self._writing_since: float | None = None  # loop time the write in flight started
        self._slow: SlowReader | None = None  # the bounds were exceeded; cleared once within them
        self.jobs: dict[int, Job | _Preparing] = {}
        self._pending: list[_Outgoing] = []
        self._filling: _Outgoing | None = None  # the last of `_pending`, while news joins it
        self._last: spb.MultiplexEvent | None = None  # the last event of `_filling`
        self._last_id = 0  # the id of `_last` (read back from protobuf, it costs more)
        self._closed = False  # the client half-closed, or its stream broke
        self._end_when_idle = False  # drain() was called
        self._malformed: CoreError | None = None  # the client broke the protocol: the stream ends with it
        self._waiter: asyncio.Future[None] | None = None

    async def serve(self, requests: AsyncIterator[spb.MultiplexGenerateRequest | Malformed]) -> None:
        """Serve the stream until it ends: the client half-closed (or the server drains) and
        no request is open, or the call is cancelled. Open requests are cancelled on the way
        out."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                if self._malformed is not None:
                    log.info("%s %s", self._malformed.code.name, self._malformed.message)
                    await self.context.abort_with_status(self._malformed.to_status())
                if self._pending:
                    out = self._pending.pop(0)
                    if out is self._filling:
                        self._filling, self._last = None, None
                    self.queued -= out.queued
                    self._writing_since = self._loop.time()
                    await self.context.write(out.message())
                    self._writing_since = None
                    if self._slow is not None and self.queued <= self.bounds.max_queued:
                        self._slow = None
                elif (self._closed or self._end_when_idle) and not self.jobs:
                    return
                else:
                    self._waiter = asyncio.get_running_loop().create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
        finally:
            reader.cancel()
            jobs, self.jobs = list(self.jobs.values()), {}
            for job in jobs:
                job.cancel()

    def drain(self) -> None:
        """Refuse new starts with UNAVAILABLE; end the stream once no request is open."""
        self.draining = self._end_when_idle = True
        self._wake()

    async def _read(self, requests: AsyncIterator[spb.MultiplexGenerateRequest | Malformed]) -> None:
        try:
            async for req in requests:
                if isinstance(req, Malformed):
                    self._malformed = req.error("MultiplexGenerate")
                    break
                if len(req.starts) > MAX_STARTS_PER_MESSAGE:
                    self._malformed = Overloaded(
                        f"A MultiplexGenerate message may start at most {MAX_STARTS_PER_MESSAGE} requests; "
                        f"this one starts {len(req.starts)}. Send them in several messages.",
                        reason="TOO_MANY_STARTS",
                    )
                    break
                for start in req.starts:
                    self._start(start.id, start.request, start.steps)
                for rid in req.cancels:
                    self._cancel(rid)
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the call ended: the writer's side finds out
        finally:
            self._closed = True
            self._wake()

    def _refuse_duplicate(self, rid: int, request_id: str) -> None:
        """Refuse a start whose id is open: an event of its own (never one holding the open
        request's news) with INVALID_ARGUMENT, reason DUPLICATE_ID; the open request runs on
        untouched, and its own events and terminal status follow (generate_service.proto)."""
        error = InvalidArgument(
            f"Request id {rid} is already open on this stream; this start was refused and the open request "
            "goes on. Use an id that is not open.",
            field="id",
            reason="DUPLICATE_ID",
        )
        self._last = None  # not the open request's event
        self._status(rid, request_id, error)
        self._last = None  # nor the one its next news joins

    def _cancel(self, rid: int) -> None:
        """Cancel a request (the gateway gave it up); its job goes with this frame, not when
        the stream's next message comes."""
        job = self.jobs.pop(rid, None)
        if job is not None:
            job.cancel()

    def _start(self, rid: int, request: spb.GenerateRequest, steps: bool) -> None:
        request_id = request.request_id or uuid.uuid4().hex
        trace = None if self.tracing is None else self.tracing.begin(request.trace_context)
        req = None
        try:
            if self.draining:
                raise NotReady("The server is shutting down; retry on another replica.")
            if rid in self.jobs:
                self._refuse_duplicate(rid, request_id)
                return
            if self._slow is not None:
                raise self._slow
            req = convert.to_generation_request(request, request_id, self.caller, self.tenant)
            if self.pipeline.tokenizes_off_loop(req):
                task = self._start_off_loop(rid, request_id, req, steps, trace)
                self.jobs[rid] = _Preparing(asyncio.create_task(task), request_id)
                return
            job = self.pipeline.start(self.pipeline.prepare(req), self, rid, steps, trace)
        except Exception as e:
            self._not_started(rid, request_id, e, trace, req)
            return
        if not job.done:
            self.jobs[rid] = job

    async def _start_off_loop(
        self, rid: int, request_id: str, req: GenerationRequest, steps: bool, trace: RequestTrace | None
    ) -> None:
        """Start a request whose long prompt is tokenized off the event loop; the other
        requests of the stream are started and streamed meanwhile. A cancel while it is
        prepared cancels this task (the tokenization's result is dropped)."""
        try:
            prep = await self.pipeline.prepare_off_loop(req)
            if not isinstance(self.jobs.get(rid), _Preparing):  # cancelled meanwhile
                self.pipeline.discard(prep)
                return
            del self.jobs[rid]
            job = self.pipeline.start(prep, self, rid, steps, trace)
        except Exception as e:
            self.jobs.pop(rid, None)
            self._not_started(rid, request_id, e, trace, req)
            return
        if not job.done:
            self.jobs[rid] = job
        self._wake()

    def _not_started(
        self,
        rid: int,
        request_id: str,
        error: Exception,
        trace: RequestTrace | None,
        req: GenerationRequest | None,
    ) -> None:
        """End a request that failed to start: with its CoreError, or with an internal error
        (ENGINE_FAILURE; the exception is logged). Its span, when traced, ends with that error
        (`req`: the request as converted, when it was)."""
        if not isinstance(error, CoreError):
            log.error("request %s failed", request_id, exc_info=error)
            error = EngineFailure(f"Internal error while serving request {request_id}; see the server log.")
        if trace is not None:
            trace.refused(error, req)
        self._status(rid, request_id, error)

    # ------------------------------------------------------------------ Consumer protocol

    def deliver(self, job: Job, deltas: list[ResponseDelta]) -> None:
        """Render the job's deltas into the message being filled."""
        responses = self._event(job.tag).responses
        request_id = job.request_id
        for delta in deltas:
            convert.fill_response(responses.add(), delta, request_id)
        self._count(len(deltas))

    def deliver_step(self, job: Job, text: str, token_id: int, logprob: float | None) -> None:
        """Add a plain decode step of the job to the Steps of the message being filled, or of
        a new message when the job has an event in this one (its steps must not come before
        that event: generate_service.proto, MultiplexGenerateResponse)."""
        rid = job.tag
        out = self._filling
        if out is None or out.size >= MAX_EVENTS_PER_MESSAGE or rid in out.evented:
            out = self._start_message()
        out.size += 1
        out.ids.append(rid)
        out.texts.append(text)
        out.token_ids.append(token_id)
        out.logprobs.append(_NAN if logprob is None else logprob)
        self._count(1)

    def _count(self, n: int) -> None:
        """Count `n` more messages waiting in the message being filled; past the bounds, cancel
        the stream's requests once this engine step's delivery is over (a job is delivering)."""
        out = self._filling
        if out is not None:
            out.queued += n
        self.queued += n
        if self._slow is None and (self.queued > self.bounds.max_queued or self._writing_since is not None):
            error = self.bounds.exceeded(self.queued, self._writing_since, self._loop.time)
            if error is not None:
                self._slow = error
                self._loop.call_soon(self._cancel_all, error)

    def _cancel_all(self, error: SlowReader) -> None:
        """Cancel every open request with `error` as its terminal status."""
        jobs, self.jobs = self.jobs, {}
        for rid, job in jobs.items():
            job.cancel(error)
            self.pipeline.metrics.slow_reader_cancels += 1
            self._status(rid, job.request_id, error)

    def finish(self, job: Job, error: CoreError | None) -> None:
        """Add the job's terminal status (OK, or its error)."""
        if self.jobs.get(job.tag) is job:
            del self.jobs[job.tag]
        self._status(job.tag, job.request_id, error)

    def _status(self, rid: int, request_id: str, error: CoreError | None) -> None:
        status = self._event(rid).status
        if error is None:
            status.SetInParent()
            return
        log.info("request %s: %s %s", request_id, error.code.name, error.message)
        status.MergeFromString(error.to_rpc_status().SerializeToString())

    def _event(self, rid: int) -> spb.MultiplexEvent:
        """The event of request `rid` at the end of the message being filled (a new one unless
        the last event is this request's), and a wake-up for the writer."""
        last = self._last
        if last is not None and self._last_id == rid:
            return last
        out = self._filling
        if out is None or out.size >= MAX_EVENTS_PER_MESSAGE:
            out = self._start_message()
        out.size += 1
        out.evented.add(rid)
        last = self._last = out.add_event()
        last.id = self._last_id = rid
        return last

    def _start_message(self) -> _Outgoing:
        """Start the next message to fill (and wake the writer)."""
        out = self._filling = _Outgoing()
        self._last = None  # news of a request in the new message must not join the old one
        self._pending.append(out)
        self._wake()
        return out

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
