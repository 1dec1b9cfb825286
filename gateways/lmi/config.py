"""The LMI gateway's flags and its typed settings (seed `lmi-input-output-schema.md`; DJL-Serving's
`option.*` properties of the same meaning).

Each flag is also read from TRELLIS_GATEWAY_<DEST>. DJL's own `OPTION_TGI_COMPAT` is honoured
after TRELLIS_GATEWAY_TGI_COMPAT, so a DJL deployment's environment keeps working.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from aiohttp import web

from envflags import EnvArgumentParser
from gateways.common.config import GatewayConfig, settings_from


@dataclass(frozen=True, slots=True)
class LmiSettings:
    """Effective settings of one LMI gateway process.

    Attributes:
        batching: "rolling" (continuous batching schema) or "dynamic" (static batches, list
            inputs).
        tgi_compat: answer in HF TGI's shapes (JSON array, SSE, TGI token records).
        output_formatter: framing of streamed responses, "jsonlines" or "sse" (None: jsonlines,
            or sse with tgi_compat); a request's Accept header wins.
        enable_streaming: dynamic batching streams unless the request sets `stream`.
        accept_any_model: TGI's OpenAI routes (`/v1/chat/completions`, `/v1/completions`)
            answer whatever `model` a request names with the served model, as TGI does.
    """

    batching: str = "rolling"
    tgi_compat: bool = False
    output_formatter: str | None = None
    enable_streaming: bool = False
    accept_any_model: bool = False

    @property
    def dynamic(self) -> bool:
        """Whether the dynamic-batch schema is served."""
        return self.batching == "dynamic"


SETTINGS_KEY = web.AppKey("lmi_settings", LmiSettings)


def add_arguments(parser: EnvArgumentParser) -> None:
    """The LMI gateway's flags."""
    d = LmiSettings()
    parser.add_argument(
        "--batching",
        choices=["rolling", "dynamic"],
        default=d.batching,
        help="request schema: rolling (continuous) batch, or dynamic (static) batch with list inputs",
    )
    parser.add_argument(
        "--tgi-compat",
        action=argparse.BooleanOptionalAction,
        default=d.tgi_compat,
        env_aliases=("OPTION_TGI_COMPAT",),
        help="answer in HF TGI's shapes (JSON array, SSE streaming, TGI token records)",
    )
    parser.add_argument(
        "--accept-any-model",
        action=argparse.BooleanOptionalAction,
        default=d.accept_any_model,
        help="TGI's /v1/chat/completions and /v1/completions answer any model name with the served model (TGI's "
        "behaviour; HF's InferenceClient sends a placeholder); off: another name is 404",
    )
    parser.add_argument(
        "--output-formatter",
        choices=["jsonlines", "sse"],
        default=d.output_formatter,
        help="framing of streamed responses (default: jsonlines, or sse with --tgi-compat); "
        "a request's 'Accept: text/event-stream' asks for sse",
    )
    parser.add_argument(
        "--enable-streaming",
        action=argparse.BooleanOptionalAction,
        default=d.enable_streaming,
        help="dynamic batching: stream {\"outputs\": [...]} lines unless the request sets 'stream'",
    )


def load_settings(config: GatewayConfig) -> LmiSettings:
    """The settings of this process, from its parsed flags."""
    return settings_from(LmiSettings, config.options)
