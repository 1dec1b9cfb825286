"""The OpenAI gateway (`trellis-gateway openai`, port 8000): OpenAI chat completions over the
core (docs/openai.md; LMI's chat completions schema, which follows OpenAI's API), legacy
completions, the Responses API, plus the model list and a health route.

Modules: `config` (settings), `translate` (model cards), `routes` (handlers), `completion_*`
(`/v1/completions`), `responses_*` (`/v1/responses`: schema, translation, routes, stored
responses, OpenAPI schemas). The chat
completions schema, its translation and OpenAI's error object are shared with the LMI gateway
and live in gateways.common.chat.
"""

from __future__ import annotations

from aiohttp import web

from gateways.common.app import make_gateway_app
from gateways.common.chat.errors import render_http_error
from gateways.common.config import GatewayConfig
from gateways.openai import openapi, routes
from gateways.openai.config import SETTINGS_KEY, add_arguments, load_settings

__all__ = ["DEFAULT_PORT", "add_arguments", "make_app"]

DEFAULT_PORT = 8000


def make_app(config: GatewayConfig) -> web.Application:
    """The OpenAI gateway's aiohttp application."""
    return make_gateway_app(
        config,
        SETTINGS_KEY,
        load_settings(config),
        render_error=render_http_error,
        add_routes=routes.add_routes,
        openapi=openapi.document,
    )
