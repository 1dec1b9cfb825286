"""The gateway's request span (gateways.common.tracing.tracing_middleware) around handlers that
answer, fail or redirect, on a real aiohttp server on loopback, exported to a real OTLP/HTTP
receiver: its name, route and status attributes, status ERROR for a 5xx answer or a handler that
fails after its response started, and no span for probes and scrapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateways.common.tracing import GatewayTracing, tracing_middleware
from oteltrace import TracingSettings, start_tracing
from tests.integration.otlp_receiver import Receiver


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": request.match_info.get("name", "")})


async def unavailable(request: web.Request) -> web.Response:
    return web.json_response({"error": "later"}, status=503)


async def broken(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"partial")
    raise RuntimeError("lost the stream")


async def moved(request: web.Request) -> web.Response:
    raise web.HTTPFound("/items/x")


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[str, Receiver, GatewayTracing]]:
    receiver = await Receiver().start()
    tracing = GatewayTracing(start_tracing(TracingSettings(receiver.url, 1.0), "trellis-gateway-test", "test"))
    app = web.Application(middlewares=[tracing_middleware(tracing)])
    app.router.add_get("/items/{name}", ok)
    app.router.add_get("/unavailable", unavailable)
    app.router.add_get("/broken", broken)
    app.router.add_get("/moved", moved)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", receiver, tracing
    await runner.cleanup()
    await receiver.stop()


@pytest.mark.parametrize(
    ("path", "route", "status", "error"),
    [
        ("/items/a", "/items/{name}", 200, ""),
        ("/unavailable", "/unavailable", 503, "HTTP 503"),
        ("/moved", "/moved", 302, ""),
        ("/broken", "/broken", None, "RuntimeError: lost the stream"),
    ],
)
async def test_the_request_span_names_its_route_and_status(served, path, route, status, error):
    base, receiver, tracing = served
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(base + path, allow_redirects=False) as r:
                await r.read()
        except aiohttp.ClientPayloadError:
            assert status is None  # the broken handler's response is cut short
    await asyncio.to_thread(tracing.shutdown)  # exports what is batched
    [span] = await receiver.wait_for(1)
    assert span.name == f"GET {route}" and span.server and span.service == "trellis-gateway-test"
    assert span.attributes["http.route"] == route and span.attributes["url.path"] == path
    assert span.attributes.get("http.response.status_code") == status
    assert span.error == bool(error) and span.status_message == error


async def test_probes_and_scrapes_get_no_span(served):
    base, receiver, tracing = served
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/metrics", "/items/b"):
            async with http.get(base + path) as r:
                assert r.status == 200
    await asyncio.to_thread(tracing.shutdown)
    assert [s.attributes["url.path"] for s in await receiver.wait_for(1)] == ["/items/b"]
