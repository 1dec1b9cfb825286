"""The LMI gateway (`trellis-gateway lmi`, port 8080): DJL-Serving LMI's `/invocations`,
`/predictions/{model_name}` and `/ping` on the Trellis core.

Serves the rolling-batch schema (jsonlines or SSE streaming, TGI compatibility for the Hugging
Face `text-generation` client), the dynamic-batch schema, and chat completions bodies on
`/invocations` (seeds `lmi-input-output-schema.md`, `lmi-chat-completions-schema.md`). Usage,
flags and deliberate differences from DJL: docs/lmi.md.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from gateways.common.app import make_base_app
from gateways.common.config import GatewayConfig
from gateways.lmi import routes

DEFAULT_PORT = 8080

_TRUE = {"1", "true", "yes", "on"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The LMI gateway's flags (each also settable as TRELLIS_GATEWAY_<DEST>).

    DJL's own `OPTION_TGI_COMPAT=true` is honoured as the default of `--tgi-compat` when the
    parser carries an environment (gateways.common.config's EnvArgumentParser); the flag and
    TRELLIS_GATEWAY_TGI_COMPAT win over it.
    """
    environ = getattr(parser, "environ", None) or {}
    parser.add_argument(
        "--batching",
        choices=["rolling", "dynamic"],
        default="rolling",
        help="request schema: rolling (continuous) batch, or dynamic (static) batch with list inputs",
    )
    parser.add_argument(
        "--tgi-compat",
        action=argparse.BooleanOptionalAction,
        default=environ.get("OPTION_TGI_COMPAT", "").strip().lower() in _TRUE,
        help="answer in HF TGI's shapes (JSON array, SSE streaming, TGI token records); also OPTION_TGI_COMPAT",
    )
    parser.add_argument(
        "--output-formatter",
        choices=["jsonlines", "sse"],
        default=None,
        help="framing of streamed responses (default: jsonlines, or sse with --tgi-compat); "
        "a request's 'Accept: text/event-stream' asks for sse",
    )
    parser.add_argument(
        "--enable-streaming",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="dynamic batching: stream {\"outputs\": [...]} lines unless the request sets 'stream'",
    )


def make_app(config: GatewayConfig) -> web.Application:
    """The LMI gateway's aiohttp application."""
    app = make_base_app(config)
    app.router.add_post("/invocations", routes.invocations)
    app.router.add_post("/predictions/{model_name}", routes.predictions)
    app.router.add_get("/ping", routes.ping)
    return app
