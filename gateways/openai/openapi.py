"""The OpenAI gateway's OpenAPI document (`GET /openapi.json`, gateways.common.openapi).

Request bodies are the pydantic models (`ChatCompletionRequest`, `CompletionRequest`,
`ResponsesRequest`); the Responses API's schemas are gateways.openai.responses_openapi's. The
chat responses are gateways.common.chat.openapi's. The completions responses are built by hand
in gateways.common.chat.completion_translate and written here after OpenAI's `Completion` object
(openai-python `types/completion.py`, `completion_choice.py`), as the translation renders
them; the model card and list after `types/model.py`, as gateways.openai.translate renders
them. Anthropic's Messages routes are gateways.openai.messages_openapi's.
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.chat import openapi as chat
from gateways.common.chat.completion_schema import CompletionRequest
from gateways.common.chat.translate import FINISH_REASONS
from gateways.common.config import GatewayConfig
from gateways.common.framing import SSE_CONTENT_TYPE
from gateways.openai import messages_openapi
from gateways.openai.config import OpenAISettings
from gateways.openai.responses_openapi import paths as responses_paths

MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "root": {"type": "string", "description": "A LoRA adapter's directory."},
        "parent": {"type": "string", "description": "A LoRA adapter's base model."},
    },
}

LOAD_LORA = {
    "type": "object",
    "required": ["lora_name", "lora_path"],
    "additionalProperties": False,
    "properties": {
        "lora_name": {"type": "string", "minLength": 1},
        "lora_path": {"type": "string", "minLength": 1},
        "load_inplace": {"type": "boolean", "description": "Accepted and ignored."},
    },
}

UNLOAD_LORA = {
    "type": "object",
    "required": ["lora_name"],
    "additionalProperties": False,
    "properties": {
        "lora_name": {"type": "string", "minLength": 1},
        "lora_int_id": {"type": "integer", "description": "Accepted and ignored."},
    },
}


def document(config: GatewayConfig, settings: OpenAISettings) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of the OpenAI gateway (a pure function of its settings)."""
    c = oa.Components()
    words = sorted(set(FINISH_REASONS.values()))
    refs = chat.add_chat(c, words)
    error = refs["error"]
    generation_errors = oa.errors_as(error, oa.GENERATION_ERRORS)
    completion_request = c.model(CompletionRequest, extra=chat.ignored_fields())
    chunk = c.add("TextCompletionChunk", chat.text_completion(words, chunk=True))
    model = c.add("Model", MODEL)

    def sse(item: oa.Schema) -> dict[str, Any]:
        return oa.stream_content(SSE_CONTENT_TYPE, {"anyOf": [item, error]}, done=True)

    paths = {
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "summary": "Chat completions (seed lmi-chat-completions-schema.md).",
                "requestBody": oa.request_body(refs["request"]),
                "responses": oa.responses(
                    {**oa.json_content(refs["completion"]), **sse(refs["chunk"])},
                    {**generation_errors, 415: error},
                    ok_description="A chat.completion object, or with `stream: true` an SSE stream of "
                    "chat.completion.chunk objects; an error after the stream started is an `{error}` event.",
                ),
            }
        },
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "summary": "Legacy completions: one Generate call per prompt.",
                "requestBody": oa.request_body(completion_request),
                "responses": oa.responses(
                    {
                        **oa.json_content(c.add("TextCompletion", chat.text_completion(words, chunk=False))),
                        **sse(chunk),
                    },
                    generation_errors,
                    ok_description="A text_completion object, or with `stream: true` an SSE stream of chunks.",
                ),
            }
        },
        **responses_paths(c, error, generation_errors),
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The served model and its LoRA adapters, as OpenAI's model list.",
                "responses": oa.responses(
                    oa.json_content(
                        c.add(
                            "ModelList",
                            {
                                "type": "object",
                                "required": ["object", "data"],
                                "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
                            },
                        )
                    ),
                    oa.errors_as(error, (500, 503, 504)),
                ),
            }
        },
        "/v1/models/{model}": {
            "get": {
                "operationId": "retrieveModel",
                "summary": "The served model's or a LoRA adapter's card; 404 for any other name.",
                "parameters": [oa.path_parameter("model", "The model's name.")],
                "responses": oa.responses(oa.json_content(model), oa.errors_as(error, (404, 500, 503, 504))),
            }
        },
        "/v1/load_lora_adapter": {
            "post": {
                "operationId": "loadLoraAdapter",
                "summary": "Register a PEFT LoRA adapter on the core (vLLM's route; the core needs "
                "--enable-lora-management, else 400).",
                "requestBody": oa.request_body(c.add("LoadLoRAAdapterRequest", LOAD_LORA)),
                "responses": oa.responses(
                    {"text/plain": {"schema": {"type": "string"}}},
                    oa.errors_as(error, (400, 404, 409, 500, 503, 504)),
                ),
            }
        },
        "/v1/unload_lora_adapter": {
            "post": {
                "operationId": "unloadLoraAdapter",
                "summary": "Unregister a LoRA adapter (vLLM's route; the core needs --enable-lora-management).",
                "requestBody": oa.request_body(c.add("UnloadLoRAAdapterRequest", UNLOAD_LORA)),
                "responses": oa.responses(
                    {"text/plain": {"schema": {"type": "string"}}},
                    oa.errors_as(error, (400, 404, 500, 503, 504)),
                ),
            }
        },
        **messages_openapi.add_messages(c),
        "/health": oa.health_path("health", "serving", "not_serving"),
    }
    doc = oa.document(
        config,
        title="Trellis OpenAI gateway",
        description="OpenAI chat completions, completions, responses and models, and Anthropic's Messages API, "
        "over the Trellis core (docs/openai.md, docs/anthropic.md).",
        paths=paths,
        components=c,
        error=error,
        open_paths=("/health",),
    )
    messages_openapi.secure(doc)
    return doc
