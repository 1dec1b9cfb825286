"""The reader of a MultiplexGenerate stream (`MultiplexedStream`) hands each open request its
part of a core message as deltas: each entry of `steps` as a Step tuple `(text, token_id,
logprob)` with NaN read as "no logprob" (None), a request's several entries (steps the core sent
together while the gateway was behind) in order, and its steps before its events; then it tells
each request with news once (one listener call per core message). Entries and events of a
request no longer open are skipped, and a request whose listener fails is cancelled (the core is
told) without costing the others their deltas.

The stream runs as in the gateway, its reader and writer tasks included; a stand-in for the
gRPC call hands the reader each core message (serialized and parsed, as from the wire) and
records what the writer sends."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_call import CoreCall, Delta
from gateways.common.multiplexed import MAX_STARTS_PER_MESSAGE, MultiplexedStream

NAN = math.nan


class StreamCall:
    """The MultiplexGenerate call as grpc.aio gives it, at the methods the stream uses."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: list[spb.MultiplexGenerateRequest] = []
        self.reads = 0
        self.reading = asyncio.Event()  # set on each read

    async def read(self) -> Any:
        self.reads += 1
        self.reading.set()
        return await self.incoming.get()

    async def write(self, msg: spb.MultiplexGenerateRequest) -> None:
        self.sent.append(msg)

    async def done_writing(self) -> None:
        pass


class Stub:
    def __init__(self) -> None:
        self.call = StreamCall()

    def MultiplexGenerate(self, metadata: Any = None) -> StreamCall:
        return self.call


class Client:
    """The CoreClient at what a stream asks of its owner: no retries, hooks recorded."""

    metadata: tuple[tuple[str, str], ...] = ()

    def __init__(self) -> None:
        self._delivering = False
        self.delivered = 0
        self.closed: list[MultiplexedStream] = []

    def _delivered(self) -> None:
        self._delivering = False
        self.delivered += 1

    def _closed(self, stream: MultiplexedStream) -> None:
        self.closed.append(stream)

    def _retry(self, call: CoreCall, error: Any, failed: MultiplexedStream) -> bool:
        return False


class Listened:
    """A CoreCall as a relay listens to it: the deltas of every listener call recorded."""

    def __init__(self, name: str, fail: bool = False):
        self.call = CoreCall(spb.GenerateRequest(request_id=name), steps=True)
        self.got: list[list[Delta]] = []
        self.fail = fail
        self.call.listen(self._on_news)

    def _on_news(self) -> None:
        if self.fail:
            raise RuntimeError("a rendering bug")
        self.got.append(self.call.take())


class Core:
    """One multiplexed stream to a stand-in core: `send(msg)` delivers a core message and
    returns once the reader has handed it out."""

    def __init__(self, stream: MultiplexedStream, call: StreamCall):
        self.stream = stream
        self.call = call
        self.messages = 0

    async def send(self, msg: spb.MultiplexGenerateResponse) -> None:
        self.messages += 1
        self.call.incoming.put_nowait(spb.MultiplexGenerateResponse.FromString(msg.SerializeToString()))
        while self.call.reads <= self.messages:  # the reader asks for the next one once done
            self.call.reading.clear()
            await self.call.reading.wait()

    async def cancels(self) -> list[int]:
        """The request ids the stream has sent cancels for."""
        for _ in range(5):
            await asyncio.sleep(0)
        return [rid for msg in self.call.sent for rid in msg.cancels]


@pytest.fixture
async def core() -> AsyncIterator[Core]:
    stub = Stub()
    stream = MultiplexedStream(Client(), stub)  # type: ignore[arg-type]
    try:
        yield Core(stream, stub.call)
    finally:
        stream._reader.cancel()
        await asyncio.gather(stream._reader, stream._writer, return_exceptions=True)


def started(core: Core, *calls: Listened) -> None:
    """Start the calls on the stream, in order: their ids are 1, 2, ..."""
    for c in calls:
        core.stream.start(c.call)


def steps(*entries: tuple[int, str, int, float]) -> spb.MultiplexGenerateResponse:
    """A core message with steps of (id, text, token id, logprob) entries, in columns."""
    msg = spb.MultiplexGenerateResponse()
    for rid, text, token_id, logprob in entries:
        msg.steps.ids.append(rid)
        msg.steps.texts.append(text)
        msg.steps.token_ids.append(token_id)
        msg.steps.logprobs.append(logprob)
    return msg


def response(request_id: str, text: str = "", **fields: Any) -> spb.GenerateResponse:
    msg = spb.GenerateResponse(request_id=request_id, **fields)
    if text:
        msg.outputs.add(text=text)
    return msg


async def test_each_entry_reaches_its_request_as_a_step(core):
    """An entry's logprob is the step's; NaN (not asked for) is None; an entry of an id with no
    open request is skipped."""
    with_logprob, without, empty = Listened("a"), Listened("b"), Listened("c")
    started(core, with_logprob, without, empty)
    await core.send(steps((1, "x", 7, -0.5), (2, "y", 8, NAN), (3, "", 9, NAN), (4, "gone", 1, NAN)))
    assert with_logprob.got == [[("x", 7, -0.5)]]
    assert without.got == [[("y", 8, None)]]
    assert empty.got == [[("", 9, None)]]
    assert core.stream.client.delivered == 1


async def test_a_requests_several_entries_arrive_in_order_with_one_notify(core):
    one, two, three = Listened("a"), Listened("b"), Listened("c")
    started(core, one, two, three)
    entries = [(1, "a", 1, -1.0), (2, "p", 5, -0.125), (1, "b", 2, -2.0), (2, "q", 6, NAN), (1, "c", 3, -3.0)]
    await core.send(steps(*entries, (3, "z", 8, -0.25)))
    assert one.got == [[("a", 1, -1.0), ("b", 2, -2.0), ("c", 3, -3.0)]]
    assert two.got == [[("p", 5, -0.125), ("q", 6, None)]]
    assert three.got == [[("z", 8, -0.25)]]


async def test_a_requests_steps_come_before_its_events_of_the_same_message(core):
    """Events follow the steps of their request in one listener call; the request ends after
    both, and only then."""
    one, two = Listened("a"), Listened("b")
    started(core, one, two)
    queued = response("core-a", state=pb.GENERATE_STATE_QUEUED)
    msg = steps((1, "x", 1, NAN), (2, "y", 2, NAN), (1, "z", 3, NAN))
    msg.events.add(id=1, responses=[queued])
    await core.send(msg)
    assert one.got == [[("x", 1, None), ("z", 3, None), queued]]
    assert two.got == [[("y", 2, None)]]
    assert one.call.request_id == "core-a"

    final = response("core-a", "!")
    final.usage.completion_tokens = 3
    msg = steps((1, "w", 4, NAN))
    msg.events.add(id=1, responses=[final]).status.SetInParent()  # code 0: OK
    await core.send(msg)
    assert one.got[1:] == [[("w", 4, None), final]]
    assert (one.call.ended, one.call.error) == (True, None)
    assert 1 not in core.stream.open

    await core.send(steps((1, "late", 5, NAN), (2, "more", 6, NAN)))
    assert len(one.got) == 2  # the ended request's late entry is skipped
    assert two.got[1:] == [[("more", 6, None)]]


async def test_an_error_status_ends_a_request_after_its_news(core):
    one = Listened("a")
    started(core, one)
    await core.send(steps((1, "x", 1, NAN)))
    msg = steps((1, "y", 2, NAN))
    msg.events.add(id=1).status.code = grpc.StatusCode.INTERNAL.value[0]
    msg.events[0].status.message = "engine failed"
    await core.send(msg)
    assert one.got == [[("x", 1, None)], [("y", 2, None)]]
    assert one.call.ended
    assert one.call.error is not None
    assert (one.call.error.code, one.call.error.message) == (grpc.StatusCode.INTERNAL, "engine failed")


async def test_an_ok_status_without_the_final_message_ends_the_request_incomplete(core):
    """The final message (the one with usage) must be a request's last: an OK status after a
    message without usage is INTERNAL, INCOMPLETE_STREAM, for every gateway alike."""
    one = Listened("a")
    started(core, one)
    msg = steps((1, "x", 1, NAN))
    msg.events.add(id=1, responses=[response("core-a", "y")]).status.SetInParent()  # code 0: OK
    await core.send(msg)
    assert one.got == [[("x", 1, None), response("core-a", "y")]]
    assert one.call.ended
    assert one.call.error is not None
    assert (one.call.error.code, one.call.error.reason) == (grpc.StatusCode.INTERNAL, "INCOMPLETE_STREAM")


@pytest.mark.parametrize("grouped", [False, True])
async def test_a_failing_listener_cancels_its_request_only(core, grouped):
    """The failing request is cancelled (and the core told to abort it); the others get their
    steps and events of the same message, and of later ones."""
    ok, bad, after = Listened("a"), Listened("b", fail=True), Listened("c")
    started(core, ok, bad, after)
    entries = [(1, "a", 1, NAN), (2, "b", 2, NAN), (3, "c", 3, NAN)] + ([(1, "d", 4, NAN)] if grouped else [])
    msg = steps(*entries)
    note = response("core-c", state=pb.GENERATE_STATE_SCHEDULED)
    msg.events.add(id=3, responses=[note])
    await core.send(msg)
    assert ok.got == [[("a", 1, None), ("d", 4, None)] if grouped else [("a", 1, None)]]
    assert after.got == [[("c", 3, None), note]]
    assert (bad.call.ended, bad.call.error.code if bad.call.error else None) == (True, grpc.StatusCode.CANCELLED)
    assert (ok.call.ended, after.call.ended) == (False, False)
    assert sorted(core.stream.open) == [1, 3]
    assert await core.cancels() == [2]

    await core.send(steps((1, "e", 5, NAN), (2, "f", 6, NAN), (3, "g", 7, NAN)))
    assert (ok.got[-1], after.got[-1]) == ([("e", 5, None)], [("g", 7, None)])


async def test_a_request_that_waits_takes_its_steps_and_events_in_order(core):
    """A request without a listener is woken by its news and takes them as deltas."""
    call = CoreCall(spb.GenerateRequest(request_id="r"), steps=True)
    core.stream.start(call)
    waiting = asyncio.ensure_future(call.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    queued = response("core-r", state=pb.GENERATE_STATE_QUEUED)
    msg = steps((1, "a", 10, -0.5), (1, "b", 11, -0.25))
    msg.events.add(id=1, responses=[queued, response("core-r", "c")])
    await core.send(msg)
    await waiting
    assert call.take() == [("a", 10, -0.5), ("b", 11, -0.25), queued, response("core-r", "c")]
    assert not call.pending()


async def test_the_stream_sends_each_request_with_its_steps_flag(core):
    plain, stepped = (
        CoreCall(spb.GenerateRequest(request_id="p")),
        CoreCall(spb.GenerateRequest(request_id="s"), steps=True),
    )
    core.stream.start(plain)
    core.stream.start(stepped)
    await core.cancels()
    starts = [s for msg in core.call.sent for s in msg.starts]
    assert [(s.id, s.steps, s.request.request_id) for s in starts] == [(1, False, "p"), (2, True, "s")]


async def test_a_burst_of_starts_goes_out_in_messages_the_core_accepts(core):
    """The core refuses a message with more than MAX_STARTS_PER_MESSAGE starts, so a burst is
    split, in order."""
    n = 2 * MAX_STARTS_PER_MESSAGE + 3
    started(core, *(Listened(f"r{i}") for i in range(n)))
    for _ in range(5):
        await asyncio.sleep(0)
    sizes = [len(msg.starts) for msg in core.call.sent]
    assert sizes == [MAX_STARTS_PER_MESSAGE, MAX_STARTS_PER_MESSAGE, 3]
    assert [s.id for msg in core.call.sent for s in msg.starts] == list(range(1, n + 1))
