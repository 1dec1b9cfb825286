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

import asyncio

from aiohttp import web
from aiohttp.http import StreamWriter

from gateways.common.metrics import TIMER_KEY


class ClientTooSlow(ConnectionResetError):
    """A client that reads too slowly: more than the writer's bound waits for it, or a paused
    connection took nothing within the write timeout. The writer has aborted the connection."""


class ResponseWriter:
    """Writes the body of a prepared response straight to its connection.

    While the connection takes data, `write()` hands each piece to the transport at once. While
    the transport is paused (the client reads slower than we write), pieces wait, and `drain()`
    sends everything waiting as one write once the connection takes more: pieces are merged
    into one write, never dropped or reordered. A streamed HTTP body gets chunked transfer
    encoding as aiohttp applies it.

    What waits is bounded: more than `max_waiting_bytes` waiting, or a `drain()` that waits
    longer than `write_timeout` for the connection, aborts the connection and raises
    ClientTooSlow, so a client that stops reading costs a bounded amount of memory and its
    caller cancels the request behind it rather than let output pile up.

    Args:
        request: the request answered (its protocol and payload writer).
        frames: the pieces are WebSocket frames (framed by the caller, never chunked, and no
            time-to-first-byte is recorded): the socket's upgraded request.
        max_waiting_bytes: the most bytes kept for a paused connection (0: no bound).
        write_timeout: seconds `drain()` waits for a paused connection (0: no limit).
    """

    def __init__(
        self, request: web.Request, *, frames: bool = False, max_waiting_bytes: int = 0, write_timeout: float = 0.0
    ):
        self._protocol = request.protocol
        self._writer = request.writer
        self._chunked = not frames and isinstance(self._writer, StreamWriter) and self._writer.chunked
        # Told of the first write (the client's time to first byte), then None.
        self._timer = None if frames else request.get(TIMER_KEY)
        self.waiting: list[bytes] = []
        self._waiting_bytes = 0
        self._max_waiting = max_waiting_bytes
        self._write_timeout = write_timeout or None

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
            ClientTooSlow: more than `max_waiting_bytes` would wait.
        """
        protocol = self._protocol
        if self.waiting or protocol.writing_paused:
            self.waiting.append(data)
            self._waiting_bytes += len(data)
            if self._max_waiting and self._waiting_bytes > self._max_waiting:
                self._give_up(f"more than {self._max_waiting} bytes wait for it")
            return
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
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
            ClientTooSlow: the connection took nothing within `write_timeout`.
        """
        while self.waiting:
            try:
                async with asyncio.timeout(self._write_timeout):
                    await self._writer.drain()
            except TimeoutError:
                self._give_up(f"it took nothing for {self._write_timeout:g} s")
            if self.closed:  # aiohttp's drain() returns at once on a lost connection
                self.waiting, self._waiting_bytes = [], 0
                raise ConnectionResetError("the client closed the connection")
            pieces, self.waiting = self.waiting, []
            self._waiting_bytes = 0
            self.write(b"".join(pieces))  # kept again if the connection paused meanwhile

    def _give_up(self, why: str) -> None:
        """Abort the connection (what waits is dropped) and raise ClientTooSlow."""
        self.waiting, self._waiting_bytes = [], 0
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()
        raise ClientTooSlow(f"the client reads too slowly: {why}")
