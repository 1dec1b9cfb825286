"""OpenAI's model list and model card (`GET /v1/models`, `GET /v1/models/{model}`) from the
core's GetModelInfo and ListAdapters, as pure functions (LoRA adapters are models whose
`parent` is the base, vLLM's `ModelCard` in vllm/entrypoints/openai/protocol.py, 0.10), and the
bodies of vLLM's adapter routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`).
The chat completions mapping is shared with the LMI gateway and lives in
gateways.common.chat.translate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError


def model_card(info: spb.GetModelInfoResponse, created: int, name: str | None = None) -> dict[str, Any]:
    """`{"id", "object": "model", "created", "owned_by"}` for the served model under `name` (its
    reported name, or one of its aliases)."""
    return {"id": name or info.model_name, "object": "model", "created": created, "owned_by": "trellis"}


def adapter_card(adapter: spb.AdapterInfo, base: str, created: int) -> dict[str, Any]:
    """A LoRA adapter's card: `id` its name, `root` its directory, `parent` the base model."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": created,
        "owned_by": "trellis",
        "root": adapter.path,
        "parent": base,
    }


def model_list(
    info: spb.GetModelInfoResponse, created: int, adapters: Sequence[spb.AdapterInfo] = ()
) -> dict[str, Any]:
    """`{"object": "list", "data": [card, ...]}`: the served model under its name, then under
    each alias (the core's --served-model-name), as vLLM lists its served names, then its
    LoRA adapters."""
    cards = [model_card(info, created, n) for n in (info.model_name, *info.model_aliases)]
    return {"object": "list", "data": cards + [adapter_card(a, info.model_name, created) for a in adapters]}


def adapter_request(body: Any, *, load: bool) -> tuple[str, str]:
    """(lora_name, lora_path) of a load body `{"lora_name", "lora_path"}` (lora_path "" for an
    unload body `{"lora_name"}`; vLLM's LoadLoRAAdapterRequest and UnloadLoRAAdapterRequest,
    whose `lora_int_id` is accepted and ignored).

    Raises:
        GatewayError: INVALID_ARGUMENT naming the field that is missing, not a string, or
            unknown.
    """
    if not isinstance(body, dict):
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "The body must be a JSON object.")
    allowed = {"lora_name", "lora_path", "load_inplace"} if load else {"lora_name", "lora_int_id"}
    for key in body:
        if key not in allowed:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"Unknown field '{key}'.", param=key)
    needed = ("lora_name", "lora_path") if load else ("lora_name",)
    for key in needed:
        if not isinstance(body.get(key), str) or not body[key]:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"{key} must be a non-empty string.", param=key)
    return body["lora_name"], body.get("lora_path", "")
