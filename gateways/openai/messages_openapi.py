"""The Anthropic Messages part of the OpenAI gateway's OpenAPI document (gateways.openai.openapi).

Request bodies are the pydantic models (gateways.openai.messages_schema). The responses are
built by hand in gateways.openai.messages_translate and written here after
anthropic-sdk-python 2.10.0's models (`types/message.py`, `usage.py`, the content blocks,
`raw_message_stream_event.py` and its events, `shared/error_response.py`), as the translation
renders them. With API keys, the document takes `x-api-key` as well as the bearer scheme, and
these operations' 401 has Anthropic's error body.
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.framing import SSE_CONTENT_TYPE
from gateways.openai import messages_errors
from gateways.openai.messages_schema import IGNORED_FIELDS, CountTokensRequest, MessagesRequest
from gateways.openai.messages_translate import FINISH_REASONS

PATHS = ("/v1/messages", "/v1/messages/count_tokens")

_STRING = {"type": "string"}

ERROR: oa.Schema = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {
                    "enum": sorted({messages_errors.error_type(s) for s in (400, 401, 403, 404, 429, 500, 504, 529)})
                },
                "message": _STRING,
            },
        },
        "request_id": {"type": ["string", "null"]},
    },
}

_TEXT = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _STRING}}
_THINKING = {
    "type": "object",
    "required": ["type", "thinking", "signature"],
    "properties": {"type": {"const": "thinking"}, "thinking": _STRING, "signature": _STRING},
}
_TOOL_USE = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {"type": {"const": "tool_use"}, "id": _STRING, "name": _STRING, "input": {"type": "object"}},
}
_BLOCK = {"anyOf": [_TEXT, _THINKING, _TOOL_USE]}
_COUNT = {"type": "integer", "minimum": 0}
USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens"],
    "properties": {
        "input_tokens": {**_COUNT, "description": "Prompt tokens not read from the prefix cache."},
        "output_tokens": _COUNT,
        "cache_read_input_tokens": {**_COUNT, "description": "Prompt tokens read from the prefix cache."},
        "cache_creation_input_tokens": _COUNT,
    },
}
_STOP_REASON = {"enum": [*sorted({*FINISH_REASONS.values(), "tool_use"}), None]}


def message(*, started: bool = False) -> oa.Schema:
    """The `message` object; as message_start carries it (`started`), without content yet."""
    return {
        "type": "object",
        "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        "properties": {
            "id": {"type": "string", "description": "msg_<unique>; also the request-id header."},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "model": _STRING,
            "content": {"type": "array", "maxItems": 0} if started else {"type": "array", "items": _BLOCK},
            "stop_reason": _STOP_REASON,
            "stop_sequence": {"type": ["string", "null"]},
            "usage": USAGE,
        },
    }


def _event(kind: str, **properties: oa.Schema) -> oa.Schema:
    return {
        "type": "object",
        "required": ["type", *properties],
        "properties": {"type": {"const": kind}, **properties},
    }


_INDEX = {"type": "integer", "minimum": 0}
_DELTA = {
    "anyOf": [
        _event("text_delta", text=_STRING),
        _event("thinking_delta", thinking=_STRING),
        _event("signature_delta", signature=_STRING),
        _event("input_json_delta", partial_json=_STRING),
    ]
}
EVENT: oa.Schema = {
    "anyOf": [
        _event("message_start", message=message(started=True)),
        _event("ping"),
        _event("content_block_start", index=_INDEX, content_block=_BLOCK),
        _event("content_block_delta", index=_INDEX, delta=_DELTA),
        _event("content_block_stop", index=_INDEX),
        _event(
            "message_delta",
            delta={
                "type": "object",
                "required": ["stop_reason", "stop_sequence"],
                "properties": {"stop_reason": _STOP_REASON, "stop_sequence": {"type": ["string", "null"]}},
            },
            usage=USAGE,
        ),
        _event("message_stop"),
    ],
    "description": "One event; its SSE `event:` name is its `type`.",
}


def add_messages(c: oa.Components) -> dict[str, Any]:
    """Add the Messages schemas to `c`; returns the two paths' items."""
    extra = {name: {"description": "Accepted and ignored."} for name in sorted(IGNORED_FIELDS)}
    error = c.add("AnthropicError", ERROR)
    errors = {**oa.errors_as(error, oa.GENERATION_ERRORS), 415: error, 529: error}
    errors.pop(503, None)
    stream = oa.stream_content(SSE_CONTENT_TYPE, {"anyOf": [c.add("MessageStreamEvent", EVENT), error]})
    return {
        "/v1/messages": {
            "post": {
                "operationId": "createMessage",
                "summary": "Anthropic's Messages API (docs/anthropic.md).",
                "parameters": [_VERSION],
                "requestBody": oa.request_body(c.model(MessagesRequest, extra=extra)),
                "responses": oa.responses(
                    {**oa.json_content(c.add("AnthropicMessage", message())), **stream},
                    errors,
                    ok_description="A message object, or with `stream: true` an SSE stream of named events; an "
                    "error after the stream started is an `event: error`.",
                ),
            }
        },
        "/v1/messages/count_tokens": {
            "post": {
                "operationId": "countMessageTokens",
                "summary": "The input tokens of a Messages request, counted by the core's Tokenize.",
                "parameters": [_VERSION],
                "requestBody": oa.request_body(c.model(CountTokensRequest, extra=extra)),
                "responses": oa.responses(
                    oa.json_content(
                        c.add(
                            "MessageTokensCount",
                            {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _COUNT}},
                        )
                    ),
                    {**oa.errors_as(error, (400, 404, 500, 504, 529)), 415: error},
                ),
            }
        },
    }


_VERSION = {
    "name": "anthropic-version",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "Accepted and not checked.",
}


def secure(doc: dict[str, Any]) -> None:
    """With API keys: the key may also come as `x-api-key` (gateways.common.auth), and the
    Messages operations' 401 is Anthropic's error."""
    schemes = doc["components"].get("securitySchemes")
    if schemes is None:
        return
    schemes["x-api-key"] = {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "Anthropic's header."}
    doc["security"] = [{"bearer": []}, {"x-api-key": []}]
    for path in PATHS:
        doc["paths"][path]["post"]["responses"]["401"]["content"] = oa.json_content(oa.ref("AnthropicError"))
