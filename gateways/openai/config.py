"""The OpenAI gateway's settings: it has no flags of its own (the common ones, core address,
port, timeouts and body size, cover it; see docs/openai.md)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from aiohttp import web

from gateways.common.config import GatewayConfig, settings_from


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    """Effective settings of one OpenAI gateway process.

    Attributes:
        created: Unix seconds when the gateway started, the `created` of its model card.
    """

    created: int = field(default_factory=lambda: int(time.time()))


SETTINGS_KEY = web.AppKey("openai_settings", OpenAISettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags: none."""


def load_settings(config: GatewayConfig) -> OpenAISettings:
    """The settings of this process."""
    return settings_from(OpenAISettings, config.options)
