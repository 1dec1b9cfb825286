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

This is the only module of the gateway that reads the environment or the file system.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import ValidationError

from gateways.common.config import GatewayConfig
from gateways.ws.schema import GenerationConfig, first_error

ENV_PREFIX = "MODEL_DEFAULT_"
DEFAULT_ENV_FILE = ".env"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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
        defaults: generation defaults "from .env".
        env_file: the .env file read, or None.
    """

    max_prompts_per_batch: int = 64
    max_frame_bytes: int = 1024 * 1024
    max_in_flight_prompts: int = 256
    heartbeat_seconds: float = 20.0
    max_queued_events: int = 4096
    defaults: GenerationConfig = field(default_factory=GenerationConfig)
    env_file: str | None = None


def _parse(name: str, raw: str, kind: Any) -> Any:
    value = raw.strip()
    if kind is bool:
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: expected true or false")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None


_KINDS = {"num_beams": int, "top_k": int, "max_new_tokens": int, "do_sample": bool}


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
        if raw is None or not raw.strip():
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
    """WsSettings from the gateway's options (see gateways.ws.add_arguments) and environment.

    Raises:
        ValueError: a bad .env value or a missing --env-file.
    """
    environ = os.environ if environ is None else environ
    env_file = resolve_env_file(config.option("env_file"))
    d = WsSettings()
    return WsSettings(
        max_prompts_per_batch=config.option("max_prompts_per_batch", d.max_prompts_per_batch),
        max_frame_bytes=config.option("max_frame_bytes", d.max_frame_bytes),
        max_in_flight_prompts=config.option("max_in_flight_prompts", d.max_in_flight_prompts),
        heartbeat_seconds=config.option("heartbeat_seconds", d.heartbeat_seconds),
        max_queued_events=config.option("max_queued_events", d.max_queued_events),
        defaults=load_generation_defaults(env_file, environ),
        env_file=env_file,
    )
