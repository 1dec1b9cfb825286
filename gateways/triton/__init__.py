"""The Triton gateway: Triton's generate extension (`/v2/models/{model}[/versions/{version}]/generate`
and `generate_stream`) and KServe v2 health and metadata, on the core's Generate stream.

`trellis-gateway triton [--model-version N] [--ignore-unknown-parameters]`, default port 8001.
Usage and the places where we differ from Triton: docs/triton.md.
"""

from __future__ import annotations

from aiohttp import web

from gateways.common.app import make_gateway_app
from gateways.common.config import GatewayConfig
from gateways.triton import errors, openapi, routes
from gateways.triton.config import SETTINGS_KEY, add_arguments, load_settings

__all__ = ["DEFAULT_PORT", "add_arguments", "make_app"]

DEFAULT_PORT = 8001


def make_app(config: GatewayConfig) -> web.Application:
    """The Triton gateway's aiohttp application."""
    return make_gateway_app(
        config,
        SETTINGS_KEY,
        load_settings(config),
        render_error=errors.render_http_error,
        add_routes=routes.add_routes,
        openapi=openapi.document,
    )
