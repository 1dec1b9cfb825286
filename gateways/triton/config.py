"""The Triton gateway's flags and its typed settings."""

from __future__ import annotations

import argparse
import importlib.metadata
from dataclasses import dataclass, field

from aiohttp import web

from envflags import EnvArgumentParser
from gateways.common.config import GatewayConfig, settings_from
from gateways.triton.translate import is_version


def _package_version() -> str:
    try:
        return importlib.metadata.version("trellis")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True, slots=True)
class TritonSettings:
    """Effective settings of one Triton gateway process.

    Attributes:
        model_version: the version the served model answers to in URLs and responses (None:
            the core's GetModelInfo.model_version).
        ignore_unknown_parameters: accept and ignore unknown generate parameters instead of
            answering 400.
        server_version: the version in KServe v2 server metadata (this package's).
    """

    model_version: str | None = None
    ignore_unknown_parameters: bool = False
    server_version: str = field(default_factory=_package_version)


SETTINGS_KEY = web.AppKey("triton_settings", TritonSettings)


def _model_version(text: str) -> str:
    if not is_version(text):
        raise argparse.ArgumentTypeError(f"a model version is an integer greater than 0, got {text!r}")
    return str(int(text))


def add_arguments(parser: EnvArgumentParser) -> None:
    """The gateway's own flags."""
    d = TritonSettings()
    parser.add_argument(
        "--model-version",
        type=_model_version,
        default=d.model_version,
        help="version the served model answers to in URLs and responses (default: the core's model_version)",
    )
    parser.add_argument(
        "--ignore-unknown-parameters",
        action=argparse.BooleanOptionalAction,
        default=d.ignore_unknown_parameters,
        help="accept and ignore unknown generate parameters instead of answering 400",
    )


def load_settings(config: GatewayConfig) -> TritonSettings:
    """The settings of this process, from its parsed flags."""
    return settings_from(TritonSettings, config.options)
