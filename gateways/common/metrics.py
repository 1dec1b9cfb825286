"""A gateway's Prometheus metrics, served on its own HTTP port at `GET /metrics`.

What the client sees, per route (the aiohttp resource, e.g. "/v1/chat/completions"):
- `trellis_gateway_requests_total{route, method, status}`: answered requests by HTTP status
  (499, nginx's "client closed request", for a client that went away while its handler ran);
- `trellis_gateway_active_streams`: streamed responses (SSE, JSON lines) and WebSocket
  connections open now;
- `trellis_gateway_client_disconnects_total{route}`: clients that went away before their
  response ended;
- `trellis_gateway_time_to_first_token_seconds{route}`: request arrival to the first body
  bytes of a streamed HTTP response (lifecycle-only messages write nothing, so this is the
  first token's write);
- `trellis_gateway_e2e_request_latency_seconds{route}`: request arrival to the end of its
  response (WebSocket connections, which carry many requests, are not observed).

And the connections (gateways.common.connections): `trellis_gateway_connections` open now,
`trellis_gateway_refused_connections_total` (over --max-connections),
`trellis_gateway_header_timeouts_total` (first headers later than --header-timeout),
`trellis_gateway_accept_errors_total` (accept() out of descriptors or memory).

Updates happen once per request (the middleware) and once per streamed response (its first
write), never per token. Bucket edges are vLLM's, as the core's (core.metrics; the gateway
island cannot import the core's).

Each app has its own registry (`METRICS_KEY`), so several gateways can run in one process.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest

#: vLLM's TTFT bucket edges, in seconds (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's request latency bucket edges, in seconds.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip

#: The status recorded for a client that went away before its status was sent.
CLIENT_CLOSED = 499


class GatewayMetrics:
    """The metric objects of one gateway app, on their own registry (with process metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "trellis_gateway_requests", "Answered requests.", ["route", "method", "status"], registry=r
        )
        self.active_streams = Gauge(
            "trellis_gateway_active_streams", "Streamed responses and WebSocket connections open.", registry=r
        )
        self.disconnects = Counter(
            "trellis_gateway_client_disconnects", "Clients gone before their response ended.", ["route"], registry=r
        )
        self.slow_clients = Counter(
            "trellis_gateway_slow_client_cancels",
            "Streamed requests cancelled because their client read too slowly "
            "(--max-buffered-bytes waiting, or nothing taken for --write-timeout).",
            ["route"],
            registry=r,
        )
        self.ttft = Histogram(
            "trellis_gateway_time_to_first_token_seconds",
            "Arrival to the first body bytes of a streamed response.",
            ["route"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "trellis_gateway_e2e_request_latency_seconds",
            "Arrival to the end of the response.",
            ["route"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.connections = Gauge(
            "trellis_gateway_connections", "Client connections open (at most --max-connections).", registry=r
        )
        self.refused_connections = Counter(
            "trellis_gateway_refused_connections",
            "Connections answered 503 and closed because --max-connections were open.",
            registry=r,
        )
        self.header_timeouts = Counter(
            "trellis_gateway_header_timeouts",
            "Connections closed because their first request's headers took over --header-timeout.",
            registry=r,
        )
        self.accept_errors = Counter(
            "trellis_gateway_accept_errors",
            "Failed accept() calls for lack of file descriptors or memory (logged at most once per "
            "--accept-error-log-interval).",
            registry=r,
        )
        ProcessCollector(registry=r)


METRICS_KEY = web.AppKey("gateway_metrics", GatewayMetrics)


class RequestTimer:
    """One request's timing, on the request (`TIMER_KEY`): what the relay reports to the
    middleware (first bytes written, client gone)."""

    __slots__ = ("disconnected", "first_write", "start", "streaming", "too_slow")

    def __init__(self, start: float):
        self.start = start
        self.first_write = 0.0
        self.streaming = False
        self.disconnected = False
        self.too_slow = False

    def wrote(self) -> None:
        """The first body bytes of a streamed response went out (later calls are free no-ops
        for the caller, which checks `first_write` itself)."""
        if not self.first_write:
            self.first_write = asyncio.get_running_loop().time()


TIMER_KEY = web.RequestKey("trellis_request_timer", RequestTimer)


def client_gone(request: web.Request) -> None:
    """Record that the client went away before its response ended."""
    timer = request.get(TIMER_KEY)
    if timer is not None:
        timer.disconnected = True


def client_too_slow(request: web.Request) -> None:
    """Record that the request was cancelled because its client read too slowly."""
    timer = request.get(TIMER_KEY)
    if timer is not None:
        timer.too_slow = True


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the request by route, method and status; observe its latencies (outermost
    middleware, so it sees the status the error middleware rendered)."""
    loop = asyncio.get_running_loop()
    timer = request[TIMER_KEY] = RequestTimer(loop.time())
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        timer.disconnected = True
        status = CLIENT_CLOSED
        raise
    finally:
        metrics = request.app[METRICS_KEY]
        route = _route(request)
        metrics.requests.labels(route, request.method, str(status)).inc()
        if timer.disconnected:
            metrics.disconnects.labels(route).inc()
        if timer.too_slow:
            metrics.slow_clients.labels(route).inc()
        if timer.streaming:
            metrics.active_streams.dec()
        if timer.first_write:
            metrics.ttft.labels(route).observe(timer.first_write - timer.start)
        if not request.get(_WS_KEY):
            metrics.e2e.labels(route).observe(loop.time() - timer.start)


_WS_KEY = web.RequestKey("trellis_websocket", bool)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp on_response_prepare: a streamed response or WebSocket connection is open."""
    if isinstance(response, web.Response):
        return
    timer = request.get(TIMER_KEY)
    if timer is None or timer.streaming:
        return
    timer.streaming = True
    if isinstance(response, web.WebSocketResponse):
        request[_WS_KEY] = True
    request.app[METRICS_KEY].active_streams.inc()


async def metrics_route(request: web.Request) -> web.Response:
    """`GET /metrics`: the Prometheus text exposition of this gateway's registry."""
    body = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_metrics(app: web.Application) -> None:
    """Give `app` its metrics: the registry, the prepare hook and `GET /metrics` (the
    middleware is added by the caller, outermost)."""
    app[METRICS_KEY] = GatewayMetrics()
    app.on_response_prepare.append(on_prepare)
    app.router.add_get("/metrics", metrics_route)
