"""The OpenAI gateway's settings: the common flags (core address, port, timeouts and body size),
plus `--reasoning-parser` and where the Responses API keeps stored responses (docs/openai.md).

Each flag is also read from TRELLIS_GATEWAY_<DEST>.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from aiohttp import web

from envflags import EnvArgumentParser
from gateways.common.config import GatewayConfig, settings_from
from gateways.common.reasoning import PARSERS
from gateways.openai.responses_store import store_kind


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    """Effective settings of one OpenAI gateway process.

    Attributes:
        created: Unix seconds when the gateway started, the `created` of its model card.
        reasoning_parser: how reasoning is told apart from the answer in generated text (a
            name in gateways.common.reasoning.PARSERS, vLLM's names); "" for none: all text is
            content.
        response_store: where stored responses are kept: "memory" (in this process, lost on
            restart), "none" (nothing is stored) or a Redis URL (shared, with a TTL).
        response_store_max: how many responses the memory store keeps (least recently used
            dropped first).
        response_store_ttl: seconds a Redis store keeps a response.
        default_max_tokens: a chat request without max_tokens generates up to "context" (the rest
            of the model's context, OpenAI's and vLLM's default) or the "core"'s default
            (GetModelInfo default_max_new_tokens).
        accept_any_model: chat and legacy completions answer whatever `model` a request names
            (and `GET /v1/models/{model}` any name) with the served model, as TGI does; off:
            another name is 404.
    """

    created: int = field(default_factory=lambda: int(time.time()))
    reasoning_parser: str = ""
    response_store: str = "memory"
    response_store_max: int = 1000
    response_store_ttl: int = 30 * 24 * 3600
    accept_any_model: bool = False
    default_max_tokens: str = "context"


SETTINGS_KEY = web.AppKey("openai_settings", OpenAISettings)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _store(text: str) -> str:
    try:
        return store_kind(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: EnvArgumentParser) -> None:
    """The gateway's own flags: the reasoning parser and the Responses API's store."""
    d = OpenAISettings(created=0)
    parser.add_argument(
        "--reasoning-parser",
        choices=["", *PARSERS],
        default="",
        help="read the model's <think> reasoning out of its text (vLLM's parser names): chat completions "
        "return it as message.reasoning / delta.reasoning, /v1/responses as reasoning items, /v1/messages as "
        "thinking blocks; empty: none",
    )
    parser.add_argument(
        "--default-max-tokens",
        choices=["context", "core"],
        default=d.default_max_tokens,
        help="what a chat request without max_tokens gets: the rest of the context (OpenAI's and vLLM's default) "
        "or the core's --default-max-new-tokens",
    )
    parser.add_argument(
        "--accept-any-model",
        action=argparse.BooleanOptionalAction,
        default=d.accept_any_model,
        help="chat and completions requests may name any model: the served one answers (TGI's behaviour, for "
        "clients that send a placeholder name), so a LoRA adapter cannot be chosen by name; off: another name is 404",
    )
    parser.add_argument(
        "--response-store",
        type=_store,
        default=d.response_store,
        help="where /v1/responses keeps stored responses: memory (this process, lost on restart), none, or a "
        "Redis URL redis://host:port/db (shared by gateways, kept --response-store-ttl seconds)",
    )
    parser.add_argument(
        "--response-store-max",
        type=_positive,
        default=d.response_store_max,
        help="how many stored responses the memory store keeps (least recently used dropped first)",
    )
    parser.add_argument(
        "--response-store-ttl",
        type=_positive,
        default=d.response_store_ttl,
        help="seconds a Redis response store keeps each response",
    )


def load_settings(config: GatewayConfig) -> OpenAISettings:
    """The settings of this process."""
    return settings_from(OpenAISettings, config.options)
