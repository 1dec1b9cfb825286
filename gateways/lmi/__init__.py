"""The LMI gateway (`trellis-gateway lmi`, port 8080): DJL-Serving LMI's `/invocations`,
`/predictions/{model_name}` and `/ping` on the Trellis core, and Hugging Face TGI's own routes
(`/generate`, `/generate_stream`, `/info`, `/health`, ...: gateways.lmi.tgi_routes).

Serves the rolling-batch schema (jsonlines or SSE streaming, TGI compatibility for the Hugging
Face `text-generation` client), the dynamic-batch schema, and chat completions bodies on
`/invocations` (seeds `lmi-input-output-schema.md`, `lmi-chat-completions-schema.md`). Usage,
flags and deliberate differences from DJL: docs/lmi.md.
"""

from __future__ import annotations

from aiohttp import web

from gateways.common.app import make_gateway_app
from gateways.common.config import GatewayConfig
from gateways.lmi import adapters, errors, openapi, routes, tgi_routes
from gateways.lmi.config import SETTINGS_KEY, add_arguments, load_settings

__all__ = ["DEFAULT_PORT", "add_arguments", "make_app"]

DEFAULT_PORT = 8080


def add_routes(app: web.Application) -> None:
    """DJL's routes (gateways.lmi.routes, and its adapter management: gateways.lmi.adapters) and
    TGI's (gateways.lmi.tgi_routes)."""
    routes.add_routes(app)
    adapters.add_routes(app)
    tgi_routes.add_routes(app)


def make_app(config: GatewayConfig) -> web.Application:
    """The LMI gateway's aiohttp application."""
    return make_gateway_app(
        config,
        SETTINGS_KEY,
        load_settings(config),
        render_error=errors.render_http_error,
        add_routes=add_routes,
        openapi=openapi.document,
    )
