"""aiohttp application and server helpers shared by the gateways."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateways.common.config import GatewayConfig
from gateways.common.core_client import CONFIG_KEY, CORE_CLIENT_KEY, CoreClient, core_client_ctx


def make_base_app(config: GatewayConfig, middlewares=()) -> web.Application:
    """An app with the config and core client attached and the body size limit applied."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=list(middlewares))
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(core_client_ctx)
    return app


def core_client(request: web.Request) -> CoreClient:
    """The app's core client."""
    return request.app[CORE_CLIENT_KEY]


def option(request: web.Request, name: str, default: Any = None) -> Any:
    """A gateway-specific option (argparse dest) of the app's GatewayConfig."""
    return request.app[CONFIG_KEY].option(name, default)


def error_middleware(render: Callable[[int, str], web.Response]):
    """A middleware that answers aiohttp's own HTTP errors (unknown path 404, wrong method 405,
    body over --max-body-bytes 413) with `render(status, message)`, the schema's error shape,
    instead of aiohttp's plain text.

    The message names the method and path for 404 and 405 ("Not Found: GET /v2/nothing"), and
    is aiohttp's explanation otherwise ("Maximum request body size 1024 exceeded, ...").
    """

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status in (404, 405) or exc.text in (None, f"{exc.status}: {exc.reason}"):
                message = f"{exc.reason}: {request.method} {request.path}"
            else:
                message = exc.text
            return render(exc.status, message)

    return middleware


async def start_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving `app` on host:port (0 picks a free port); returns the runner and the port.

    Handler cancellation is on: a client that disconnects cancels its handler task at once, and
    the handler's `finally` cancels the gRPC call (the core then aborts the engine request).
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor
    return runner, bound
