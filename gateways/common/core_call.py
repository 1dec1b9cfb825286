"""One Generate request as a gateway sees it (`CoreCall`), and the deltas it delivers.

A request's news is a list of deltas in order, each one of two shapes:
- a `spb.GenerateResponse`, exactly as Generate streams it (lifecycle states, the first and last
  tokens, token details, usage: everything but the bulk of a plain stream);
- a `Step`, `(text, token_id, logprob)`: a plain decode step (one ordinary token of sequence 0;
  generate_service.proto, Steps), the bulk of a streamed text request started with `steps`.
  It stands for `GenerateResponse {request_id, outputs: [{index: 0, text, tokens: [{id:
  token_id, logprob}]}]}`; a renderer takes it from its values, without that message.

The transport (gateways.common.multiplexed, or one Generate call per request) feeds a CoreCall;
its owner either waits (`wait()`, then `take()`) or registers a listener (`listen(fn)`), called
synchronously whenever news arrive.

A Generate stream is complete only when its last message is the final one, the one carrying
`usage` (generate_service.proto). The CoreCall checks that once, for every gateway: a call that
ends with an OK status but without its final message ends with `incomplete_stream()` (INTERNAL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
from opentelemetry import trace
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import DEADLINE_PASSED, GatewayError
from gateways.common.tracing import call_failed

#: A plain decode step: (new text, token id, logprob or None when not asked for). A plain tuple:
#: one is made per streamed token, and a tuple costs a tenth of a class instance to build.
Step = tuple[str, int, float | None]

#: One delta of a request: a whole message, or a plain decode step.
Delta = spb.GenerateResponse | Step


def incomplete_stream() -> GatewayError:
    """The error for a Generate call that ended without its final message (INTERNAL)."""
    return GatewayError(
        grpc.StatusCode.INTERNAL,
        "The model server ended the response before it finished.",
        reason="INCOMPLETE_STREAM",
    )


class CoreCall:
    """One Generate request: its deltas as they arrive, then its end.

    A listener must not raise (the transport logs it and cancels the request).

    Attributes:
        request: the request as sent.
        request_id: the request's id in the core's messages (the core's own for a request
            sent without one).
        steps: the request takes plain decode steps as `Step`s (MultiplexStart.steps).
        ended: the request ended (after its deltas), failed or was cancelled.
        error: why it ended, when not OK (`incomplete_stream()` for an OK end without the final
            message).
        started: a delta of it arrived (it can no longer be resent).
        attempts: times it was sent (a refused request is resent to another core).
        hash_key: what keeps it on its session's core, if anything.
        span: the gateway span the request serves, sent on to the core as its parent and
            marked failed when the request fails (gateways.common.tracing); None: not traced.
    """

    __slots__ = (
        "_cancel",
        "_complete",
        "_deltas",
        "_listener",
        "_queue_timer",
        "_timer",
        "_waiter",
        "attempts",
        "ended",
        "error",
        "hash_key",
        "request",
        "request_id",
        "span",
        "started",
        "steps",
    )

    def __init__(self, request: spb.GenerateRequest, *, steps: bool = False, hash_key: str | None = None):
        self.request = request
        self.request_id = request.request_id
        self.steps = steps
        self.hash_key = hash_key
        self.ended = False
        self.started = False
        self.attempts = 1
        self.error: GatewayError | None = None
        self.span: trace.Span | None = None
        self._deltas: list[Delta] = []
        self._complete = False  # the final message came
        self._cancel: Callable[[], None] = _nothing
        self._listener: Callable[[], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queue_timer: asyncio.TimerHandle | None = None

    def take(self) -> list[Delta]:
        """The deltas received since the last take, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def pending(self) -> bool:
        """Whether deltas wait to be taken."""
        return bool(self._deltas)

    async def wait(self) -> None:
        """Return once a delta waits or the request ended."""
        while not self._deltas and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever news arrive (now, if some wait already): deltas to
        `take()`, or the end (`ended`, with `error` None for OK)."""
        if not self.ended:  # an ended call keeps no listener (see _finish)
            self._listener = listener
        if self._deltas or self.ended:
            listener()

    def cancel(self) -> None:
        """Give the request up: the core aborts it within an engine step (no-op once ended)."""
        if not self.ended:
            self._finish(GatewayError(grpc.StatusCode.CANCELLED, "The request was cancelled."))
            self._listener = None
            self._cancel()

    # ------------------------------------------------------------------ transport side

    def _add_step(self, step: Step) -> None:
        """A plain decode step; the transport calls `_notify()` once the core message's news
        are all added."""
        if not self.ended:
            self._deltas.append(step)

    def _add(self, messages: Sequence[spb.GenerateResponse]) -> None:
        """Whole messages (an event's repeated field as it is: no copy per message)."""
        if self.ended or not messages:
            return
        if not self.started:
            for first in messages:
                self.request_id = first.request_id
                self.started = True
                break
        if self._queue_timer is not None and any(m.state >= pb.GENERATE_STATE_SCHEDULED or m.outputs for m in messages):
            self._queue_timer.cancel()
            self._queue_timer = None
        self._deltas.extend(messages)
        self._complete = messages[-1].HasField("usage")

    def _end(self, error: GatewayError | None) -> None:
        """The request's end (after the deltas added before); `_notify()` follows. An OK end
        without the final message is `incomplete_stream()`."""
        if not self.ended:
            if error is None and not self._complete:
                error = incomplete_stream()
            self._finish(error)
            if error is not None and self.span is not None:
                call_failed(self.span, error)

    def _notify(self) -> None:
        """Tell the owner that news arrived (deltas, the end, or both)."""
        listener = self._listener
        if self.ended:
            # A listener is a closure that holds its request's stream, and so this call:
            # dropped once told of the end, a request's objects go when its handler returns,
            # not in the garbage collector's next full pass.
            self._listener = None
        if listener is not None:
            listener()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _news(self, messages: Sequence[spb.GenerateResponse], ended: bool, error: GatewayError | None) -> None:
        """`_add(messages)`, the end when `ended`, and `_notify()`."""
        if self.ended:
            return
        self._add(messages)
        if ended:
            self._end(error)
        self._notify()

    def _set_deadline(self, seconds: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self.ended:
            self._cancel()
            self._news((), True, GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_PASSED))

    def _set_queue_deadline(self, seconds: float) -> None:
        self._queue_timer = asyncio.get_running_loop().call_later(seconds, self._queue_expired, seconds)

    def _queue_expired(self, seconds: float) -> None:
        self._queue_timer = None
        if not self.ended:
            self._cancel()
            message = (
                f"The request waited more than {seconds:g} s (--queue-timeout) for a place in the running batch; "
                "retry later."
            )
            self._news((), True, GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, message, reason="QUEUE_TIMEOUT"))

    def _finish(self, error: GatewayError | None) -> None:
        self.ended = True
        self.error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None


def _nothing() -> None:
    """The cancel of a call not sent yet."""
