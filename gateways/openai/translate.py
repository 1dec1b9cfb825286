"""OpenAI's model list and model card (`GET /v1/models`, `GET /v1/models/{model}`) from the
core's GetModelInfo, as pure functions. The chat completions mapping is shared with the LMI
gateway and lives in gateways.common.chat.translate."""

from __future__ import annotations

from typing import Any

from trellis.generate.v1 import generate_service_pb2 as spb


def model_card(info: spb.GetModelInfoResponse, created: int) -> dict[str, Any]:
    """`{"id", "object": "model", "created", "owned_by"}` for the served model."""
    return {"id": info.model_name, "object": "model", "created": created, "owned_by": "trellis"}


def model_list(info: spb.GetModelInfoResponse, created: int) -> dict[str, Any]:
    """`{"object": "list", "data": [card]}`: the one served model."""
    return {"object": "list", "data": [model_card(info, created)]}
