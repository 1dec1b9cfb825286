"""The WebSocket gateway's own settings, and the generation defaults it reads "from .env".

The seed says every `generation_config` value a client leaves out comes "from .env". The names
are those of the protocol's original implementation (alexandriaproject-io/llm-inference,
`src/config/config.py`): `MODEL_DEFAULT_NUM_BEAMS`, `MODEL_DEFAULT_DO_SAMPLE`,
`MODEL_DEFAULT_TEMPERATURE`, `MODEL_DEFAULT_TOP_P`, `MODEL_DEFAULT_TOP_K`,
`MODEL_DEFAULT_MAX_NEW_TOKENS`, `MODEL_DEFAULT_REPETITION_PENALTY`, `MODEL_DEFAULT_LENGTH_PENALTY`.
They are read from a `.env` file (`--env-file`, default `./.env` when it exists) and from the
process environment, which wins (python-dotenv's precedence). A name set in neither leaves the
field unset, so the core's engine default applies. Unlike the original, nothing is defaulted
here: its defaults (top_k 50, max_new_tokens 4096) would override the engine's.

The gateway's flags (`add_arguments`) become `WsSettings` once (`load_settings`); handlers read
it from the app (SETTINGS_KEY). This is the only module of the gateway that reads the
environment or the file system.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web
from dotenv import dotenv_values
from pydantic import ValidationError

from envflags import EnvArgumentParser, parse_bool
from gateways.common.config import GatewayConfig, settings_from
from gateways.ws.schema import GenerationConfig, first_error

ENV_PREFIX = "MODEL_DEFAULT_"
DEFAULT_ENV_FILE = ".env"


@dataclass(frozen=True)
class WsSettings:
    """Effective settings of one ws gateway process.

    Attributes:
        max_prompts_per_batch: prompts accepted in one frame.
        max_frame_bytes: largest client frame; a larger one closes the socket with 1009.
        max_in_flight_prompts: prompts running at once on one socket.
        heartbeat_seconds: interval of the server's pings (0: none); a peer that does not answer
            within half of it is disconnected.
        max_queued_events: events waiting for the socket writer before producers wait.
        env_file: the --env-file option ("": none; None: ./.env if present); after
            `load_settings`, the .env file read, or None.
        defaults: generation defaults "from .env" (read by `load_settings`).
    """

    max_prompts_per_batch: int = 64
    max_frame_bytes: int = 1024 * 1024
    max_in_flight_prompts: int = 256
    heartbeat_seconds: float = 20.0
    max_queued_events: int = 4096
    env_file: str | None = None
    defaults: GenerationConfig = field(default_factory=GenerationConfig)


SETTINGS_KEY = web.AppKey("ws_settings", WsSettings)


def add_arguments(parser: EnvArgumentParser) -> None:
    """The ws gateway's flags."""
    d = WsSettings()
    parser.add_argument(
        "--max-prompts-per-batch", type=int, default=d.max_prompts_per_batch, help="prompts accepted in one frame"
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=d.max_frame_bytes,
        help="largest client frame; a larger one closes the socket with 1009 (Message Too Big)",
    )
    parser.add_argument(
        "--max-in-flight-prompts",
        type=int,
        default=d.max_in_flight_prompts,
        help="prompts running at once on one socket",
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=d.heartbeat_seconds,
        help="interval of the server's pings; a peer silent for half of it after a ping is dropped (0: off)",
    )
    parser.add_argument(
        "--max-queued-events",
        type=int,
        default=d.max_queued_events,
        help="events waiting to be sent on one socket before its prompts wait (backpressure)",
    )
    parser.add_argument(
        "--env-file",
        default=d.env_file,
        help="file with MODEL_DEFAULT_* generation defaults (default: ./.env if present; '' for none)",
    )


def _parse(name: str, raw: str, kind: type) -> Any:
    """A MODEL_DEFAULT_* value (not blank) of type `kind` (bool: envflags.parse_bool).

    Raises:
        ValueError: naming the variable.
    """
    if kind is bool:
        try:
            return parse_bool(raw)
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: {e}") from None
    try:
        return kind(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None


_KINDS: dict[str, type] = {"num_beams": int, "top_k": int, "max_new_tokens": int, "do_sample": bool}


def load_generation_defaults(env_file: str | None, environ: Mapping[str, str]) -> GenerationConfig:
    """Generation defaults from `env_file` (if not None) overlaid with `environ`.

    Args:
        env_file: path of a .env file, or None for none.
        environ: the process environment (wins over the file).

    Raises:
        ValueError: a value that does not parse, naming the variable; a missing env_file.
    """
    values: dict[str, str | None] = {}
    if env_file is not None:
        if not Path(env_file).is_file():
            raise ValueError(f"--env-file {env_file!r} does not exist")
        values.update(dotenv_values(env_file))
    values.update({k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)})
    parsed: dict[str, Any] = {}
    for name in GenerationConfig.model_fields:
        var = ENV_PREFIX + name.upper()
        raw = values.get(var)
        if raw is None or not raw.strip():  # empty: not set (envflags' rule)
            continue
        parsed[name] = _parse(var, raw, _KINDS.get(name, float))
    try:
        return GenerationConfig.model_validate(parsed)
    except ValidationError as e:
        path, phrase = first_error(e)
        var = ENV_PREFIX + path.upper()
        raise ValueError(f"{var}={values[var]!r}: {phrase}") from None


def resolve_env_file(option: str | None, cwd: Path | None = None) -> str | None:
    """The .env file to read: the option when given ("" means none), else ./.env if present."""
    if option is not None:
        return option or None
    default = (cwd or Path.cwd()) / DEFAULT_ENV_FILE
    return str(default) if default.is_file() else None


def load_settings(config: GatewayConfig, environ: Mapping[str, str] | None = None) -> WsSettings:
    """WsSettings from the gateway's parsed flags (`add_arguments`), with the .env file resolved
    and the generation defaults read from it and the environment.

    Raises:
        ValueError: a bad .env value or a missing --env-file.
    """
    environ = os.environ if environ is None else environ
    settings = settings_from(WsSettings, config.options)
    env_file = resolve_env_file(settings.env_file)
    return replace(settings, env_file=env_file, defaults=load_generation_defaults(env_file, environ))
