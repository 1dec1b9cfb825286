"""The Triton gateway: Triton's generate extension (`/v2/models/{model}[/versions/{version}]/generate`
and `generate_stream`) and KServe v2 health and metadata, on the core's Generate stream.

`trellis-gateway triton [--model-version N] [--ignore-unknown-parameters]`, default port 8001.
Usage and the places where we differ from Triton: docs/triton.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from aiohttp import web

from gateways.common.app import make_base_app
from gateways.common.config import GatewayConfig
from gateways.triton.routes import SERVER_VERSION_KEY, add_routes, json_errors
from gateways.triton.translate import is_version

DEFAULT_PORT = 8001


def _model_version(text: str) -> str:
    if not is_version(text):
        raise argparse.ArgumentTypeError(f"a model version is an integer greater than 0, got {text!r}")
    return str(int(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags (each also read from TRELLIS_GATEWAY_<DEST>)."""
    parser.add_argument(
        "--model-version",
        type=_model_version,
        default=None,
        help="version the served model answers to in URLs and responses (default: the core's model_version)",
    )
    parser.add_argument(
        "--ignore-unknown-parameters",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accept and ignore unknown generate parameters instead of answering 400",
    )


def make_app(config: GatewayConfig) -> web.Application:
    """The gateway's aiohttp application."""
    app = make_base_app(config, middlewares=[json_errors])
    try:
        app[SERVER_VERSION_KEY] = importlib.metadata.version("trellis")
    except importlib.metadata.PackageNotFoundError:
        app[SERVER_VERSION_KEY] = "0.0.0"
    add_routes(app)
    return app
