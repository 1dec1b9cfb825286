"""The OpenAI gateway's settings: the common flags (core address, port, timeouts, body size)
plus `--reasoning-parser` (see docs/openai.md)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from aiohttp import web

from gateways.common.config import GatewayConfig, settings_from
from gateways.common.reasoning import PARSERS


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    """Effective settings of one OpenAI gateway process.

    Attributes:
        created: Unix seconds when the gateway started, the `created` of its model card.
        reasoning_parser: how reasoning is told apart from the answer in generated text (a
            name in gateways.common.reasoning.PARSERS, vLLM's names); "" for none: all text is
            content.
    """

    created: int = field(default_factory=lambda: int(time.time()))
    reasoning_parser: str = ""


SETTINGS_KEY = web.AppKey("openai_settings", OpenAISettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags."""
    parser.add_argument(
        "--reasoning-parser",
        choices=["", *PARSERS],
        default="",
        help="read the model's <think> reasoning out of its text (vLLM's parser names): chat completions "
        "return it as message.reasoning / delta.reasoning, /v1/messages as thinking blocks; empty: none",
    )


def load_settings(config: GatewayConfig) -> OpenAISettings:
    """The settings of this process."""
    return settings_from(OpenAISettings, config.options)
