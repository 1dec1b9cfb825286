"""`ResponseWriter` keeps what a paused connection cannot take and sends it merged, as one
write, once the connection takes more, also when the connection paused again before that write
(asyncio's flow control: the client reads slower than records come); a closed connection raises
ConnectionResetError. The protocol and transport stand in for aiohttp's, at the two attributes
and two methods the writer uses, so a pause can be held across a drain."""

from __future__ import annotations

import pytest

from gateways.common import streaming
from gateways.common.streaming import ResponseWriter


class Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return self.closing


class Protocol:
    def __init__(self) -> None:
        self.transport: Transport | None = Transport()
        self.writing_paused = False


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
        self.writer = Writer(self.protocol, pauses)


def writer(request: Request) -> ResponseWriter:
    return ResponseWriter(request, None)  # type: ignore[arg-type]


async def test_records_wait_while_paused_and_go_as_one_write():
    request = Request()
    out = writer(request)
    out.write(b"a")
    request.protocol.writing_paused = True
    out.write(b"b")
    out.write(b"c")
    assert request.protocol.transport.sent == [b"a"]
    merged = streaming.WRITES.merged_writes
    await out.drain()
    assert request.protocol.transport.sent == [b"a", b"bc"]
    assert (out.waiting, streaming.WRITES.merged_writes) == ([], merged + 1)


async def test_a_connection_paused_again_keeps_the_merged_records_until_it_takes_them():
    request = Request(pauses=1)  # the first drain returns with the connection still paused
    out = writer(request)
    request.protocol.writing_paused = True
    out.write(b"b")
    out.write(b"c")
    await out.drain()
    assert (request.protocol.transport.sent, request.writer.drains) == ([b"bc"], 2)


@pytest.mark.parametrize("gone", ["closing", "no transport"])
async def test_a_closed_connection_raises(gone):
    request = Request()
    if gone == "closing":
        request.protocol.transport.closing = True
    else:
        request.protocol.transport = None
    with pytest.raises(ConnectionResetError):
        writer(request).write(b"a")
