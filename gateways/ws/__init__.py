"""The WebSocket gateway (`trellis-gateway ws`, port 8765): the `/ws` batch protocol
(alexandriaproject-io/llm-inference's) over the core's Generate stream, with request_id as the
continue-generation key. See docs/websocket.md.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from gateways.common.app import make_gateway_app
from gateways.common.config import GatewayConfig
from gateways.ws import errors, openapi, routes
from gateways.ws.config import SETTINGS_KEY, add_arguments, load_settings

__all__ = ["DEFAULT_PORT", "add_arguments", "make_app"]

DEFAULT_PORT = 8765

log = logging.getLogger(__name__)


def make_app(config: GatewayConfig) -> web.Application:
    """The ws gateway's aiohttp application.

    Raises:
        ValueError: a bad MODEL_DEFAULT_* value or a missing --env-file.
    """
    settings = load_settings(config)
    log.info(
        "ws generation defaults (from %s and the environment): %s",
        settings.env_file or "no .env file",
        json.dumps(settings.defaults.model_dump(exclude_none=True), sort_keys=True),
    )
    return make_gateway_app(
        config,
        SETTINGS_KEY,
        settings,
        render_error=errors.render_http_error,
        add_routes=routes.add_routes,
        openapi=openapi.document,
    )
