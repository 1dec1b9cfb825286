"""The OpenAI gateway (`trellis-gateway openai`, port 8000): OpenAI chat completions over the
core's gRPC Generate stream (seed `lmi-chat-completions-schema.md`, DESIGN.md).

Modules: `schema` (request shapes and types), `translate` (pure request/response mapping),
`errors` (OpenAI's error object, before and after the first byte), `routes` (aiohttp handlers;
`routes.handle_chat` is also the LMI gateway's chat path).
"""

from __future__ import annotations

import argparse
import time

from aiohttp import web

from gateways.common.app import make_base_app
from gateways.common.config import GatewayConfig
from gateways.openai.routes import CREATED_KEY, add_routes, handle_chat, openai_error_middleware

__all__ = ["DEFAULT_PORT", "add_arguments", "handle_chat", "make_app"]

DEFAULT_PORT = 8000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags: none; the common ones (core address, port, timeouts, body
    size) cover it (see docs/openai.md)."""


def make_app(config: GatewayConfig) -> web.Application:
    """The OpenAI gateway's aiohttp application."""
    app = make_base_app(config, middlewares=[openai_error_middleware])
    app[CREATED_KEY] = int(time.time())  # `created` of the model card: when this gateway started
    add_routes(app)
    return app
