"""`ResponseWriter`: the one place that writes to a client's connection without a coroutine per
write, for streamed HTTP responses (gateways.common.streaming.relay) and WebSocket frames
(gateways.ws.routes).

It relies on four aiohttp internals, confined here and held to by
tests/unit/gateways/test_writer.py (aiohttp's own StreamWriter) and test_relay.py (a real aiohttp
server on loopback): `request.protocol`
(`writing_paused`, asyncio's flow control, and `transport`), `request.writer.drain()` (returns
once the connection takes more), and `StreamWriter.chunked` (aiohttp chose chunked transfer
encoding while preparing the response: HTTP/1.1 without a length).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from aiohttp.http import StreamWriter

from gateways.common.metrics import TIMER_KEY


@dataclass
class WriteCounters:
    """What the gateway's streamed writes did, since the process started.

    Attributes:
        writes: writes to a client's connection.
        merged_writes: writes that merged several pieces that had waited for a paused
            connection (a client reading slower than the records come).
        merged_pieces: the pieces those merged writes carried.
    """

    writes: int = 0
    merged_writes: int = 0
    merged_pieces: int = 0


#: The process's write counters (tests read them to see that merging happened).
WRITES = WriteCounters()


class ResponseWriter:
    """Writes the body of a prepared response straight to its connection.

    While the connection takes data, `write()` hands each piece to the transport at once. While
    the transport is paused (the client reads slower than we write), pieces wait, and `drain()`
    sends everything waiting as one write once the connection takes more: pieces are merged
    into one write, never dropped or reordered. A streamed HTTP body gets chunked transfer
    encoding as aiohttp applies it.

    Args:
        request: the request answered (its protocol and payload writer).
        frames: the pieces are WebSocket frames (framed by the caller, never chunked, and no
            time-to-first-byte is recorded): the socket's upgraded request.
    """

    def __init__(self, request: web.Request, *, frames: bool = False):
        self._protocol = request.protocol
        self._writer = request.writer
        self._chunked = not frames and isinstance(self._writer, StreamWriter) and self._writer.chunked
        # Told of the first write (the client's time to first byte), then None.
        self._timer = None if frames else request.get(TIMER_KEY)
        self.waiting: list[bytes] = []

    @property
    def paused(self) -> bool:
        """Whether a write now would wait (the connection is paused, or pieces wait)."""
        return bool(self.waiting) or self._protocol.writing_paused

    @property
    def closed(self) -> bool:
        """Whether the connection is closed or closing."""
        transport = self._protocol.transport
        return transport is None or transport.is_closing()

    def write(self, data: bytes) -> None:
        """Send `data` now, or keep it for `drain()` while the connection is paused.

        Raises:
            ConnectionResetError: the connection is closed.
        """
        protocol = self._protocol
        if self.waiting or protocol.writing_paused:
            self.waiting.append(data)
            return
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        WRITES.writes += 1
        if self._timer is not None:
            self._timer.wrote()
            self._timer = None
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    async def writable(self) -> None:
        """Return once the connection takes data (at once when it is not paused).

        Raises:
            ConnectionResetError: the connection closed meanwhile.
        """
        await self._writer.drain()

    async def drain(self) -> None:
        """Send what waits, merged into one write, as the connection takes it.

        Raises:
            ConnectionResetError: the connection closed meanwhile.
        """
        while self.waiting:
            await self._writer.drain()
            pieces, self.waiting = self.waiting, []
            if len(pieces) > 1:
                WRITES.merged_writes += 1
                WRITES.merged_pieces += len(pieces)
            self.write(b"".join(pieces))  # kept again if the connection paused meanwhile
