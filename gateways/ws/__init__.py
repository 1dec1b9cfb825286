"""The WebSocket gateway (`trellis-gateway ws`, port 8765): the `/ws` batch protocol of
shared/seeds/websocket-protocol.md over the core's Generate stream, with request_id as the
continue-generation key. See docs/websocket.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import weakref

from aiohttp import web

from gateways.common.app import make_base_app
from gateways.common.config import GatewayConfig
from gateways.ws.config import WsSettings, load_settings
from gateways.ws.routes import SETTINGS_KEY, SOCKETS_KEY, close_sockets, websocket

DEFAULT_PORT = 8765
ROUTES = ("/ws", "/api/ws")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ws gateway's flags (each also read from TRELLIS_GATEWAY_<DEST>)."""
    d = WsSettings()
    parser.add_argument(
        "--max-prompts-per-batch", type=int, default=d.max_prompts_per_batch, help="prompts accepted in one frame"
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=d.max_frame_bytes,
        help="largest client frame; a larger one closes the socket with 1009 (Message Too Big)",
    )
    parser.add_argument(
        "--max-in-flight-prompts",
        type=int,
        default=d.max_in_flight_prompts,
        help="prompts running at once on one socket",
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=d.heartbeat_seconds,
        help="interval of the server's pings; a peer silent for half of it after a ping is dropped (0: off)",
    )
    parser.add_argument(
        "--max-queued-events",
        type=int,
        default=d.max_queued_events,
        help="events waiting to be sent on one socket before its prompts wait (backpressure)",
    )
    parser.add_argument(
        "--env-file",
        default=None,
        help="file with MODEL_DEFAULT_* generation defaults (default: ./.env if present; '' for none)",
    )


def make_app(config: GatewayConfig) -> web.Application:
    """The ws gateway app: `/ws` and `/api/ws`, plus the base app's core client.

    Raises:
        ValueError: a bad MODEL_DEFAULT_* value or a missing --env-file.
    """
    settings = load_settings(config)
    log.info(
        "ws generation defaults (from %s and the environment): %s",
        settings.env_file or "no .env file",
        json.dumps(settings.defaults.model_dump(exclude_none=True), sort_keys=True),
    )
    app = make_base_app(config)
    app[SETTINGS_KEY] = settings
    app[SOCKETS_KEY] = weakref.WeakSet()
    for path in ROUTES:
        app.router.add_get(path, websocket)
    app.on_shutdown.append(close_sockets)
    return app
