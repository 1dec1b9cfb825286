"""OpenAI's model list and model card (`GET /v1/models`, `GET /v1/models/{model}`) from the
core's GetModelInfo, as pure functions. The chat completions mapping is shared with the LMI
gateway and lives in gateways.common.chat.translate."""

from __future__ import annotations

from typing import Any

from trellis.generate.v1 import generate_service_pb2 as spb


def model_card(info: spb.GetModelInfoResponse, created: int, name: str | None = None) -> dict[str, Any]:
    """`{"id", "object": "model", "created", "owned_by"}` for the served model under `name` (its
    reported name, or one of its aliases)."""
    return {"id": name or info.model_name, "object": "model", "created": created, "owned_by": "trellis"}


def model_list(info: spb.GetModelInfoResponse, created: int) -> dict[str, Any]:
    """`{"object": "list", "data": [card, ...]}`: the served model under its name, then under
    each alias (the core's --served-model-name), as vLLM lists its served names."""
    return {"object": "list", "data": [model_card(info, created, n) for n in (info.model_name, *info.model_aliases)]}
