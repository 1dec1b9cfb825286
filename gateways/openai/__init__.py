"""The OpenAI gateway (`trellis-gateway openai`, port 8000): OpenAI chat completions over the
core (docs/openai.md; LMI's chat completions schema, which follows OpenAI's API), OpenAI's
legacy completions, the Responses API, Anthropic's Messages API (docs/anthropic.md), the model
list and a health route.

Modules: `config` (settings), `translate` (model cards), `routes` (handlers), `completion_*`
(`/v1/completions`), `responses_*` (`/v1/responses`: schema, translation, routes, stored
responses, OpenAPI schemas). The chat
completions schema, its translation and OpenAI's error object are shared with the LMI gateway
and live in gateways.common.chat.
"""

from __future__ import annotations

from aiohttp import web

from gateways.common.app import make_gateway_app
from gateways.common.chat import errors
from gateways.common.config import GatewayConfig
from gateways.openai import messages_errors, openapi, routes
from gateways.openai.config import SETTINGS_KEY, add_arguments, load_settings

__all__ = ["DEFAULT_PORT", "add_arguments", "make_app"]

DEFAULT_PORT = 8000


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error in the shape of the API asked: Anthropic's on `/v1/messages...`,
    OpenAI's elsewhere."""
    if request.path.startswith(messages_errors.PATH_PREFIX):
        return messages_errors.render_http_error(request, status, message)
    return errors.render_http_error(request, status, message)


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
