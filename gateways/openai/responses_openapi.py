"""OpenAPI description of the Responses API routes (gateways.common.openapi): the request body is
the pydantic model (`ResponsesRequest`, plus the fields read and ignored); the response object,
its output items, its events and the stored-response answers are written here after
openai-python 3.52.0 `types/responses/` (`response.py`, `response_output_message.py`,
`response_function_tool_call.py`, `response_reasoning_item.py`, `response_usage.py`,
`response_stream_event.py`, `response_item_list.py`), as gateways.openai.responses_translate and responses_route render
them.
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.framing import SSE_CONTENT_TYPE
from gateways.openai.responses_schema import IGNORED_FIELDS, ResponsesRequest

_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_COUNT = {"type": "integer", "minimum": 0}
_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}


def _object(required: list[str], properties: dict[str, Any]) -> oa.Schema:
    return {"type": "object", "required": required, "properties": properties}


OUTPUT_TEXT = _object(
    ["type", "text", "annotations"],
    {
        "type": {"const": "output_text"},
        "text": _STRING,
        "annotations": {"type": "array"},
        "logprobs": {"type": "array"},
    },
)

MESSAGE_ITEM = _object(
    ["id", "type", "status", "role", "content"],
    {
        "id": _STRING,
        "type": {"const": "message"},
        "status": _ITEM_STATUS,
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": OUTPUT_TEXT},
    },
)

CALL_ITEM = _object(
    ["id", "type", "status", "call_id", "name", "arguments"],
    {
        "id": _STRING,
        "type": {"const": "function_call"},
        "status": _ITEM_STATUS,
        "call_id": _STRING,
        "name": _STRING,
        "arguments": {"type": "string", "description": "JSON text."},
    },
)

REASONING_TEXT = _object(["type", "text"], {"type": {"const": "reasoning_text"}, "text": _STRING})

REASONING_ITEM = _object(
    ["id", "type", "summary", "content"],
    {
        "id": _STRING,
        "type": {"const": "reasoning"},
        "status": _ITEM_STATUS,
        "summary": {"type": "array", "maxItems": 0, "description": "Always empty: no summaries are made."},
        "content": {"type": "array", "items": REASONING_TEXT},
    },
)

USAGE = _object(
    ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"],
    {
        "input_tokens": _COUNT,
        "input_tokens_details": _object(
            ["cached_tokens", "cache_write_tokens"], {"cached_tokens": _COUNT, "cache_write_tokens": _COUNT}
        ),
        "output_tokens": _COUNT,
        "output_tokens_details": _object(["reasoning_tokens"], {"reasoning_tokens": _COUNT}),
        "total_tokens": _COUNT,
    },
)


def response_schema(output_item: oa.Schema) -> oa.Schema:
    """The `response` object (`Response`), its output items `output_item`."""
    return _object(
        ["id", "object", "created_at", "status", "model", "output", "usage", "error", "incomplete_details"],
        {
            "id": {"type": "string", "description": "resp_<unique>; also the x-request-id header."},
            "object": {"const": "response"},
            "created_at": {"type": "integer", "description": "Unix seconds."},
            "status": {"enum": ["in_progress", "completed", "incomplete", "failed"]},
            "model": _STRING,
            "output": {"type": "array", "items": output_item},
            "usage": {"anyOf": [USAGE, {"type": "null"}]},
            "error": {
                "anyOf": [
                    _object(["code", "message"], {"code": {"enum": ["server_error", "rate_limit_exceeded"]}}),
                    {"type": "null"},
                ]
            },
            "incomplete_details": {
                "anyOf": [_object(["reason"], {"reason": {"const": "max_output_tokens"}}), {"type": "null"}]
            },
            "instructions": _NULLABLE_STRING,
            "max_output_tokens": {"type": ["integer", "null"]},
            "metadata": {"type": "object", "additionalProperties": _STRING},
            "parallel_tool_calls": {"type": "boolean"},
            "previous_response_id": _NULLABLE_STRING,
            "store": {"type": "boolean"},
            "temperature": {"type": ["number", "null"]},
            "top_p": {"type": ["number", "null"]},
            "text": {"type": "object"},
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
            "tools": {"type": "array", "items": {"type": "object"}},
            "user": _NULLABLE_STRING,
        },
    )


#: The event types a stream carries (`ResponseStreamEvent` members this server sends).
EVENT_TYPES = (
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
)


def event_schema(response: oa.Schema, output_item: oa.Schema) -> oa.Schema:
    """One streamed event's `data` (module docstring; the fields each type carries)."""
    return _object(
        ["type", "sequence_number"],
        {
            "type": {"enum": list(EVENT_TYPES)},
            "sequence_number": _COUNT,
            "response": response,
            "item": output_item,
            "output_index": _COUNT,
            "content_index": _COUNT,
            "item_id": _STRING,
            "part": {"anyOf": [OUTPUT_TEXT, REASONING_TEXT]},
            "delta": _STRING,
            "text": _STRING,
            "arguments": _STRING,
            "name": _STRING,
            "logprobs": {"type": "array"},
            "code": _NULLABLE_STRING,
            "message": _STRING,
            "param": _NULLABLE_STRING,
        },
    )


_INPUT_ITEM = _object(
    ["id", "type"],
    {"id": _STRING, "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]}},
)

ITEM_LIST = _object(
    ["object", "data", "first_id", "last_id", "has_more"],
    {
        "object": {"const": "list"},
        "data": {"type": "array", "items": _INPUT_ITEM},
        "first_id": _NULLABLE_STRING,
        "last_id": _NULLABLE_STRING,
        "has_more": {"type": "boolean"},
    },
)

DELETED = _object(
    ["id", "object", "deleted"], {"id": _STRING, "object": {"const": "response"}, "deleted": {"const": True}}
)


def _query(name: str, schema: oa.Schema, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def paths(c: oa.Components, error: oa.Schema, generation_errors: dict[int, oa.Schema]) -> dict[str, Any]:
    """The Responses API's `paths` entries, their schemas added to `c`."""
    extra = {name: {"description": "Accepted and ignored."} for name in sorted(IGNORED_FIELDS)}
    request = c.model(ResponsesRequest, extra=extra)
    output_item = c.add("ResponseOutputItem", {"anyOf": [REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM]})
    response = c.add("Response", response_schema(output_item))
    event = c.add("ResponseStreamEvent", event_schema(response, output_item))
    response_id = oa.path_parameter("response_id", "The response's id (resp_...).")
    not_found = oa.errors_as(error, (404, 503))  # 503: the response store cannot be reached
    return {
        "/v1/responses": {
            "post": {
                "operationId": "createResponse",
                "summary": "OpenAI's Responses API over the chat translation (docs/openai.md).",
                "requestBody": oa.request_body(request),
                "responses": oa.responses(
                    {**oa.json_content(response), **oa.stream_content(SSE_CONTENT_TYPE, event)},
                    {**generation_errors, 404: error, 415: error},
                    ok_description="A response object, or with `stream: true` an SSE stream of Responses events "
                    "(`event: <type>`, `data: <event>`); a failure after the start is an `error` event, then "
                    "`response.failed`.",
                ),
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "operationId": "retrieveResponse",
                "summary": "A stored response.",
                "parameters": [
                    response_id,
                    _query("stream", {"type": "boolean"}, "Replay as events: refused (400) when true."),
                ],
                "responses": oa.responses(oa.json_content(response), {**not_found, 400: error}),
            },
            "delete": {
                "operationId": "deleteResponse",
                "summary": "Delete a stored response.",
                "parameters": [response_id],
                "responses": oa.responses(oa.json_content(DELETED), not_found),
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "operationId": "listInputItems",
                "summary": "A stored response's own input items.",
                "parameters": [
                    response_id,
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "Page size (default 20)."),
                    _query("order", {"enum": ["asc", "desc"]}, "Item order (default desc)."),
                    _query("after", _STRING, "The page starts after this item id."),
                ],
                "responses": oa.responses(oa.json_content(ITEM_LIST), {**not_found, 400: error}),
            }
        },
    }
