"""aiohttp application and server helpers shared by the gateways."""

from __future__ import annotations

import logging

from aiohttp import web

from gateways.common.config import GatewayConfig
from gateways.common.core_client import CONFIG_KEY, CORE_CLIENT_KEY, CoreClient, core_client_ctx

log = logging.getLogger(__name__)


def make_base_app(config: GatewayConfig, middlewares=()) -> web.Application:
    """An app with the config and core client attached and the body size limit applied."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=list(middlewares))
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(core_client_ctx)
    return app


def core_client(request: web.Request) -> CoreClient:
    """The app's core client."""
    return request.app[CORE_CLIENT_KEY]


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
