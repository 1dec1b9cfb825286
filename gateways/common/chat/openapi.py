"""OpenAPI schemas of the chat completions schema, shared by the OpenAI gateway
(`/v1/chat/completions`) and LMI's chat bodies on `/invocations` (gateways.common.openapi).

The request is the pydantic model (`ChatCompletionRequest`), plus the OpenAI fields read and
ignored (`IGNORED_FIELDS`). The responses are built by hand in gateways.common.chat.translate;
their schemas are written here from seed `lmi-chat-completions-schema.md`, sections "Response
Schema", "Choice", "StreamChoice", "Logprobs", "TopLogprob" and "Usage", with what the
translation adds: `model`, `logprobs` as `{"content": [...]}` (OpenAI's shape), `usage: null`
on chunks when `stream_options.include_usage` is set, `tool_calls` (gateways.common.chat.tools),
and OpenAI's error object (gateways.common.chat.errors).
"""

from __future__ import annotations

from typing import Any

from gateways.common.chat import vllm
from gateways.common.chat.schema import IGNORED_FIELDS, ChatCompletionRequest
from gateways.common.openapi import Components, Schema

_NULLABLE_STRING = {"type": ["string", "null"]}

#: vLLM's `prompt_logprobs` (gateways.common.chat.translate.prompt_logprobs_list), when asked for.
PROMPT_LOGPROBS = {
    "type": "array",
    "description": "vLLM's prompt_logprobs: null for the first prompt token, then token id -> its logprob, rank and "
    "text, for the token and its top alternatives.",
    "items": {
        "type": ["object", "null"],
        "additionalProperties": {
            "type": "object",
            "required": ["logprob", "rank", "decoded_token"],
            "properties": {
                "logprob": {"type": "number"},
                "rank": {"type": ["integer", "null"], "minimum": 1},
                "decoded_token": {"type": "string"},
            },
        },
    },
}

#: OpenAI's error object, before the stream (the body) and in it (one event or line).
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "invalid_request_error, rate_limit_error, server_error, ..."},
                "param": {**_NULLABLE_STRING, "description": "The request field at fault, in OpenAI's spelling."},
                "code": {**_NULLABLE_STRING, "description": "The core's reason in lower case, or the gateway's."},
            },
        }
    },
}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_tokens_details": {
            "type": "object",
            "description": "Present when some prompt tokens' keys and values came from the engine's prefix cache.",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer", "minimum": 1}},
        },
    },
}

_TOP_LOGPROB_FIELDS: dict[str, Schema] = {
    "token": {"type": "string"},
    "logprob": {"type": "number"},
    "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
}
_TOP_LOGPROB = {"type": "object", "required": list(_TOP_LOGPROB_FIELDS), "properties": _TOP_LOGPROB_FIELDS}

#: `logprobs` of a choice: `{"content": [...]}` when asked for, else null.
LOGPROBS = {
    "type": ["object", "null"],
    "required": ["content"],
    "properties": {
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["token", "logprob", "bytes", "top_logprobs"],
                "properties": {
                    **_TOP_LOGPROB_FIELDS,
                    "logprob": {"type": ["number", "null"]},
                    "top_logprobs": {"type": "array", "items": _TOP_LOGPROB},
                },
            },
        }
    },
}

_TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}

_TOOL_CALL_DELTA = {
    "type": "object",
    "required": ["index", "function"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}

_HEAD = {
    "id": {"type": "string", "description": "chatcmpl-<unique>; also the x-request-id header."},
    "created": {"type": "integer", "description": "Unix seconds."},
    "model": {"type": "string"},
}


#: The `reasoning` field of a message and a delta.
REASONING = "The model's reasoning, with the OpenAI gateway's --reasoning-parser (vLLM's field)."


def finish_reason(words: list[str]) -> Schema:
    """A choice's `finish_reason`: one of the gateway's words, "tool_calls" (a choice that
    called a tool, gateways.common.chat.tools), or null while it runs."""
    return {"enum": [*sorted({*words, "tool_calls"}), None]}


def completion(words: list[str]) -> Schema:
    """The `chat.completion` object (seed "Response Schema", "Choice")."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **_HEAD,
            "object": {"const": "chat.completion"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": _NULLABLE_STRING,
                                "reasoning": {**_NULLABLE_STRING, "description": REASONING},
                                "tool_calls": {"type": "array", "items": _TOOL_CALL},
                            },
                        },
                        "logprobs": LOGPROBS,
                        "finish_reason": finish_reason(words),
                    },
                },
            },
            "usage": USAGE,
            "prompt_logprobs": PROMPT_LOGPROBS,
        },
    }


def chunk(words: list[str]) -> Schema:
    """A `chat.completion.chunk` (seed "Response Schema", streaming; "StreamChoice"); the usage
    chunk has no choices and `usage` set."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            **_HEAD,
            "object": {"const": "chat.completion.chunk"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "delta", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "delta": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": _NULLABLE_STRING,
                                "reasoning": {"type": "string", "description": REASONING},
                                "tool_calls": {"type": "array", "items": _TOOL_CALL_DELTA},
                            },
                        },
                        "logprobs": LOGPROBS,
                        "finish_reason": finish_reason(words),
                    },
                },
            },
            "usage": {"anyOf": [USAGE, {"type": "null"}]},
        },
    }


def ignored_fields() -> dict[str, Schema]:
    """The OpenAI and vLLM fields a request may carry that are read and ignored (`IGNORED_FIELDS`,
    gateways.common.chat.vllm.IGNORED)."""
    return {name: {"description": "Accepted and ignored."} for name in sorted(IGNORED_FIELDS | vllm.IGNORED)}


def add_chat(components: Components, words: list[str]) -> dict[str, Any]:
    """Add the chat schemas; returns references to them: "request", "completion", "chunk",
    "error"."""
    return {
        "request": components.model(ChatCompletionRequest, extra=ignored_fields()),
        "completion": components.add("ChatCompletion", completion(words)),
        "chunk": components.add("ChatCompletionChunk", chunk(words)),
        "error": components.add("OpenAIError", ERROR),
    }


def completion_choice(words: list[str]) -> Schema:
    """One choice of a `text_completion` object (OpenAI's legacy completions)."""
    return {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0, "description": "prompt * n + sequence index"},
            "text": {"type": "string"},
            "logprobs": {
                "type": ["object", "null"],
                "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                "properties": {
                    "tokens": {"type": "array", "items": {"type": "string"}},
                    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                    "top_logprobs": {
                        "type": "array",
                        "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
                        "description": "null for an echoed prompt's first token",
                    },
                    "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                },
            },
            "finish_reason": {"enum": [*words, None]},
            "prompt_logprobs": PROMPT_LOGPROBS,
        },
    }


def text_completion(words: list[str], *, chunk: bool) -> Schema:
    """A `text_completion` object: the whole answer, or one streamed chunk (usage null or absent;
    the usage chunk has no choices)."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", *([] if chunk else ["usage"])],
        "properties": {
            "id": {"type": "string", "description": "cmpl-<unique>; also the x-request-id header."},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": completion_choice(words)},
            "usage": {"anyOf": [USAGE, {"type": "null"}]} if chunk else USAGE,
        },
    }
