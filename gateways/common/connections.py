"""A gateway's connections, bounded: a cap on open connections, a deadline for the first
request's headers, and accept errors at the file descriptor limit logged at most once per interval.

aiohttp (3.14) has a keep-alive timer from the moment a connection is accepted, so a client that
connects and sends nothing, or sends its headers a byte at a time, is closed after
--keepalive-timeout; it has no separate, shorter deadline for headers (Go's ReadHeaderTimeout,
Node's headersTimeout) and no connection cap. `ConnectionGuard` wraps the server's protocol
factory to add both:

- at --max-connections open connections a new one is answered `503 Service Unavailable` with
  Retry-After, in plain text (no request was read, so no schema applies), and closed;
- a connection whose first request's headers are not complete --header-timeout seconds after
  it was accepted is closed (later requests on a keep-alive connection are bounded by
  --keepalive-timeout, as aiohttp closes a connection still waiting for a request then).

At the file descriptor limit, CPython's accept loop (asyncio selector_events
`_accept_connection`, 3.11 to 3.13) reports each failed accept() to the loop's exception
handler, up to the listen backlog per readiness event, and schedules a retry per failure, so
the reports multiply (a gateway at its limit wrote 657k tracebacks in 3 minutes).
`AcceptErrorLog` is the loop's exception handler: it logs those reports at most once per
--accept-error-log-interval, with the count of those it left out, and passes every other
report to the handler it replaced. The cap, below the descriptor limit by default, keeps a
gateway from reaching it through its own listener.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler

from gateways.common.metrics import METRICS_KEY, GatewayMetrics

log = logging.getLogger(__name__)

#: accept() errors that mean "out of descriptors or memory" (those asyncio retries).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def default_max_connections(soft_limit: int | None = None) -> int:
    """The connection cap for --max-connections 0: the soft RLIMIT_NOFILE less a quarter of it
    (at least 64 descriptors), which the gateway keeps for its channels to the core, its
    metrics and its files. At least 1; 65536 when the limit is unlimited.

    Args:
        soft_limit: the soft descriptor limit (None: this process's).
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY:
        return 65536
    return max(1, soft_limit - max(64, soft_limit // 4))


def refusal(retry_after: int) -> bytes:
    """The bytes sent to a connection over the cap: a complete HTTP/1.1 503 that closes it."""
    body = b"The gateway is at its connection limit (--max-connections); retry shortly.\n"
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Retry-After: {retry_after}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """The server's protocol factory, wrapped: counts connections, refuses those over the cap,
    closes those whose first headers are late (see the module docstring).

    Args:
        factory: aiohttp's protocol factory (the runner's `web.Server`; None until it is set up).
        max_connections: connections open at once (>= 1).
        header_timeout: seconds from accept to the end of the first request's headers (0: none).
        retry_after: the Retry-After of the 503 sent to a refused connection.
        metrics: where to count open, refused and timed-out connections.
    """

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol] | None,
        max_connections: int,
        header_timeout: float,
        retry_after: int,
        metrics: GatewayMetrics,
    ):
        self.factory = factory
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self._refusal = refusal(retry_after)
        self._metrics = metrics
        self.open = 0
        #: aiohttp's handler of each connection whose first headers are awaited.
        self.awaiting: dict[object, _Guarded] = {}
        metrics.connections.set_function(lambda: self.open)

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.max_connections:
            return _Refused(self._refusal, self._metrics)
        assert self.factory is not None
        return _Guarded(self, self.factory())

    def headers_read(self, handler: object) -> None:
        """aiohttp's `handler` (a request's `protocol`) parsed a request's headers."""
        guarded = self.awaiting.pop(handler, None)
        if guarded is not None:
            guarded.stop_timer()

    def headers_late(self, guarded: _Guarded, transport: asyncio.BaseTransport) -> None:
        self.awaiting.pop(guarded.inner, None)
        self._metrics.header_timeouts.inc()
        transport.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed at once."""

    def __init__(self, answer: bytes, metrics: GatewayMetrics):
        self._answer = answer
        self._metrics = metrics

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._metrics.refused_connections.inc()
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._answer)
        transport.close()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted and with a deadline for its first
    headers; every event goes on to it."""

    __slots__ = ("_guard", "_timer", "inner")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self._guard = guard
        self.inner = inner
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        guard.open += 1
        if guard.header_timeout > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(guard.header_timeout, guard.headers_late, self, transport)
            guard.awaiting[self.inner] = self
        self.inner.connection_made(transport)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.open -= 1
        self.stop_timer()
        self._guard.awaiting.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


#: The app's ConnectionGuard (set by `GuardedRunner`; the middleware reads it).
GUARD_KEY = web.AppKey("trellis_connection_guard", ConnectionGuard)


class GuardedRunner(web.AppRunner):
    """aiohttp's AppRunner whose sites get a ConnectionGuard as their protocol factory (TCPSite
    only calls `runner.server()` for each new connection).

    Args:
        app: the application (its METRICS_KEY metrics count the connections).
        max_connections, header_timeout, retry_after: ConnectionGuard's.
        **kwargs: AppRunner's.
    """

    def __init__(
        self, app: web.Application, *, max_connections: int, header_timeout: float, retry_after: int, **kwargs: Any
    ):
        super().__init__(app, **kwargs)
        self.guard = ConnectionGuard(None, max_connections, header_timeout, retry_after, app[METRICS_KEY])
        app[GUARD_KEY] = self.guard
        app.middlewares.insert(0, headers_read_middleware)

    async def setup(self) -> None:
        """AppRunner's setup, then the guard around its server."""
        await super().setup()
        self.guard.factory = super().server

    @property
    def server(self) -> web.Server | None:
        """The protocol factory sites listen with: the guard once set up."""
        return cast(web.Server, self.guard) if self.guard.factory is not None else None


@web.middleware
async def headers_read_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: the request's headers are in, so its connection's header deadline is off."""
    request.app[GUARD_KEY].headers_read(request.protocol)
    return await handler(request)


class AcceptErrorLog:
    """An event loop exception handler: accept() failing for lack of descriptors or memory is
    logged at most once per `interval` seconds (with how many such reports were left out) and
    counted on the app whose listening socket failed; every other report goes to the handler
    it replaced (None: the loop's default).

    Args:
        interval: seconds between two logged accept errors.
        previous: the loop's exception handler before this one.
    """

    def __init__(self, interval: float, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None):
        self.interval = interval
        self._previous = previous
        self._last = float("-inf")
        self.left_out = 0
        #: listening socket descriptor -> the metrics of the app it serves.
        self.metrics: dict[int, GatewayMetrics] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and "socket" in context):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        sock = context["socket"]
        metrics = self.metrics.get(sock.fileno())
        if metrics is not None:
            metrics.accept_errors.inc()
        now = loop.time()
        if now - self._last < self.interval:
            self.left_out += 1
            return
        self._last, left_out = now, self.left_out
        self.left_out = 0
        log.error(
            "%s on %s: %s (%d more such errors in the last %.0f s not logged); new connections wait",
            context.get("message", "accept() failed"),
            sock.getsockname(),
            exc,
            left_out,
            self.interval,
        )


def install(app: web.Application, sockets: list[Any], interval: float) -> None:
    """Count the app's accept errors on its `sockets` (listening) and put an AcceptErrorLog on
    the running loop (once; later apps on the same loop share it)."""
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    if not isinstance(handler, AcceptErrorLog):
        handler = AcceptErrorLog(interval, handler)
        loop.set_exception_handler(handler)
    for sock in sockets:
        handler.metrics[sock.fileno()] = app[METRICS_KEY]
