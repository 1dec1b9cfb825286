"""A gateway's graceful stop (SIGTERM or SIGINT: servestop.drain_on_signal), in the order a load
balancer needs:

1. health turns "not serving" at once (LMI `/ping` and OpenAI `/health` 503, Triton
   `/v2/health/ready` 400), while requests are still accepted and served, for `--drain-seconds`:
   the time the balancer's health checks take to take the gateway out of rotation;
2. the listener closes: no new connection is accepted;
3. requests in flight finish (aiohttp's graceful shutdown waits for their handlers, up to
   `SHUTDOWN_TIMEOUT_S`), idle keep-alive connections are closed, WebSockets get a going-away
   close frame; then the process exits.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from gateways.common.core_client import CORE_CLIENT_KEY

log = logging.getLogger(__name__)

#: Seconds requests in flight may still take once the listener closed (aiohttp's default).
SHUTDOWN_TIMEOUT_S = 60.0


async def drain(app: web.Application, runner: web.AppRunner, seconds: float) -> None:
    """Stop `app` served by `runner` gracefully (see the module docstring)."""
    app[CORE_CLIENT_KEY].drain()
    log.info("draining: health reports not serving for %.1f s, then in-flight requests finish", seconds)
    if seconds > 0:
        await asyncio.sleep(seconds)
    await runner.cleanup()
