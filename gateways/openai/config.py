"""The OpenAI gateway's settings: the common flags (core address, port, timeouts and body size),
plus where the Responses API keeps stored responses (docs/openai.md, "Responses API").

Each flag is also read from TRELLIS_GATEWAY_<DEST>.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from aiohttp import web

from envflags import EnvArgumentParser
from gateways.common.config import GatewayConfig, settings_from
from gateways.openai.responses_store import STORES


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    """Effective settings of one OpenAI gateway process.

    Attributes:
        created: Unix seconds when the gateway started, the `created` of its model card.
        response_store: where stored responses are kept: "memory" (in this process, lost on
            restart) or "none" (nothing is stored).
        response_store_max: how many responses the memory store keeps (least recently used
            dropped first).
    """

    created: int = field(default_factory=lambda: int(time.time()))
    response_store: str = "memory"
    response_store_max: int = 1000


SETTINGS_KEY = web.AppKey("openai_settings", OpenAISettings)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: EnvArgumentParser) -> None:
    """The gateway's own flags: the Responses API's store."""
    d = OpenAISettings(created=0)
    parser.add_argument(
        "--response-store",
        choices=list(STORES),
        default=d.response_store,
        help="where /v1/responses keeps stored responses: memory (this process, lost on restart) or none",
    )
    parser.add_argument(
        "--response-store-max",
        type=_positive,
        default=d.response_store_max,
        help="how many stored responses the memory store keeps (least recently used dropped first)",
    )


def load_settings(config: GatewayConfig) -> OpenAISettings:
    """The settings of this process."""
    return settings_from(OpenAISettings, config.options)
