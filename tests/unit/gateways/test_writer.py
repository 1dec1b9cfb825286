"""`ResponseWriter` keeps what a paused connection cannot take and sends it merged, as one
write, once the connection takes more, also when the connection paused again before that write
(asyncio's flow control: the client reads slower than records come); a closed connection raises
ConnectionResetError. `paused`, `closed` and `writable()` tell a caller that writes frames of its
own (a WebSocket) what the connection can take; a chunked HTTP body gets chunk framing, WebSocket
frames (`frames=True`) go out as they are. The protocol and transport stand in for aiohttp's, at
the two attributes and two methods the writer uses, so a pause can be held across a drain."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.http import StreamWriter

from gateways.common.metrics import TIMER_KEY, RequestTimer
from gateways.common.writer import ClientTooSlow, ResponseWriter


class Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closing = False
        self.aborted = False

    def abort(self) -> None:
        self.aborted = self.closing = True

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return self.closing


class Protocol:
    def __init__(self) -> None:
        self.transport: Transport | None = Transport()
        self.writing_paused = False
        self._paused = False  # what aiohttp's StreamWriter.drain reads: never waits here


class Writer:
    """aiohttp's payload writer at `drain()`: each drain resumes the connection after
    `pauses` more drains."""

    def __init__(self, protocol: Protocol, pauses: int) -> None:
        self.protocol = protocol
        self.pauses = pauses
        self.drains = 0

    async def drain(self) -> None:
        self.drains += 1
        if self.drains > self.pauses:
            self.protocol.writing_paused = False


class Request(dict):
    def __init__(self, pauses: int = 0) -> None:
        super().__init__()
        self.protocol = Protocol()
        self.writer: Writer | StreamWriter = Writer(self.protocol, pauses)

    @property
    def sent(self) -> list[bytes]:
        assert self.protocol.transport is not None
        return self.protocol.transport.sent


def writer(request: Request, *, frames: bool = False) -> ResponseWriter:
    return ResponseWriter(request, frames=frames)  # type: ignore[arg-type]


def chunked_request() -> Request:
    """A request whose payload writer is aiohttp's, having chosen chunked transfer encoding."""
    request = Request()
    stream_writer = StreamWriter(request.protocol, asyncio.get_running_loop())  # type: ignore[arg-type]
    stream_writer.enable_chunking()
    request.writer = stream_writer
    return request


async def test_records_wait_while_paused_and_go_as_one_write():
    request = Request()
    out = writer(request)
    out.write(b"a")
    request.protocol.writing_paused = True
    out.write(b"b")
    out.write(b"c")
    assert request.sent == [b"a"]
    await out.drain()
    assert request.sent == [b"a", b"bc"]
    assert out.waiting == []


async def test_a_connection_paused_again_keeps_the_merged_records_until_it_takes_them():
    request = Request(pauses=1)  # the first drain returns with the connection still paused
    out = writer(request)
    request.protocol.writing_paused = True
    out.write(b"b")
    out.write(b"c")
    await out.drain()
    assert (request.sent, request.writer.drains) == ([b"bc"], 2)  # type: ignore[union-attr]


@pytest.mark.parametrize("gone", ["closing", "no transport"])
async def test_a_closed_connection_raises(gone):
    request = Request()
    if gone == "closing":
        request.protocol.transport.closing = True  # type: ignore[union-attr]
    else:
        request.protocol.transport = None
    with pytest.raises(ConnectionResetError):
        writer(request).write(b"a")


async def test_paused_while_the_connection_is_paused_or_pieces_wait():
    """`paused` is true while the connection is paused, and still while pieces wait after it
    resumed (a write then would queue behind them), until a drain sent them."""
    request = Request()
    out = writer(request)
    assert not out.paused
    request.protocol.writing_paused = True
    assert out.paused
    out.write(b"a")
    request.protocol.writing_paused = False
    assert out.paused
    out.write(b"b")
    assert request.sent == []  # queued behind the waiting piece, not sent ahead of it
    await out.drain()
    assert (out.paused, request.sent) == (False, [b"ab"])


@pytest.mark.parametrize("gone", ["open", "closing", "no transport"])
async def test_closed_tells_a_closed_or_closing_connection(gone):
    request = Request()
    out = writer(request)
    if gone == "closing":
        request.protocol.transport.closing = True  # type: ignore[union-attr]
    elif gone == "no transport":
        request.protocol.transport = None
    assert out.closed is (gone != "open")


async def test_writable_returns_once_the_connection_takes_data_and_writes_nothing():
    request = Request(pauses=2)
    out = writer(request)
    request.protocol.writing_paused = True
    out.write(b"a")
    await out.writable()
    assert (request.writer.drains, request.protocol.writing_paused) == (1, True)  # type: ignore[union-attr]
    await out.writable()
    await out.writable()
    assert (request.writer.drains, request.protocol.writing_paused) == (3, False)  # type: ignore[union-attr]
    assert (request.sent, out.waiting) == ([], [b"a"])


async def test_a_chunked_body_gets_chunk_framing_and_frames_go_as_they_are():
    """With aiohttp's chunked transfer encoding each write is one chunk (hex length, CRLF, data,
    CRLF); WebSocket frames (`frames=True`) on the same connection are written unframed."""
    request = chunked_request()
    writer(request).write(b"hello, world")
    writer(request, frames=True).write(b"\x81\x02hi")
    assert request.sent == [b"c\r\nhello, world\r\n", b"\x81\x02hi"]


async def test_merged_pieces_go_as_one_chunk():
    request = chunked_request()
    out = writer(request)
    request.protocol.writing_paused = True
    out.write(b"ab")
    out.write(b"cde")
    request.protocol.writing_paused = False
    await out.drain()
    assert request.sent == [b"5\r\nabcde\r\n"]


async def test_the_first_write_of_a_response_is_timed_and_frames_are_not():
    timed, framed = Request(), Request()
    timed[TIMER_KEY] = RequestTimer(0.0)
    framed[TIMER_KEY] = RequestTimer(0.0)
    writer(timed).write(b"a")
    writer(framed, frames=True).write(b"a")
    assert timed[TIMER_KEY].first_write > 0.0
    assert framed[TIMER_KEY].first_write == 0.0


async def test_a_connection_lost_while_pieces_wait_raises_instead_of_spinning():
    """aiohttp's drain() returns at once on a lost connection: drain() must not loop on it."""
    request = Request(pauses=100)
    out = writer(request)
    request.protocol.writing_paused = True
    out.write(b"a")
    request.protocol.transport = None
    with pytest.raises(ConnectionResetError):
        await out.drain()
    assert out.waiting == []


async def test_more_waiting_than_the_bound_aborts_the_connection():
    request = Request(pauses=100)
    out = ResponseWriter(request, max_waiting_bytes=3)  # type: ignore[arg-type]
    request.protocol.writing_paused = True
    out.write(b"abc")
    with pytest.raises(ClientTooSlow):
        out.write(b"d")
    assert out.waiting == [] and request.protocol.transport.aborted  # type: ignore[union-attr]
