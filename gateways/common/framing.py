"""Wire framing shared by the gateways: strict JSON in; JSON, Server-Sent Events and JSON lines
out, as bytes."""

from __future__ import annotations

import json
from typing import Any

import orjson

from gateways.common.status import GatewayError

SSE_CONTENT_TYPE = "text/event-stream"
JSONLINES_CONTENT_TYPE = "application/jsonlines"

# Records are encoded by orjson: every streamed token is one record, and orjson encodes one in
# about a tenth of the time of the standard library's encoder (scripts/bench/overhead.py).
# Non-string keys become strings (as json.dumps does); NaN and infinities, which are not JSON,
# become null instead of json.dumps' invalid `NaN`.
_OPTIONS = orjson.OPT_NON_STR_KEYS


def loads(raw: bytes | str, what: str = "The request body") -> Any:
    """Parse strict JSON: NaN and Infinity are not JSON and are refused.

    Raises:
        GatewayError: INVALID_ARGUMENT naming `what`, for invalid UTF-8 or invalid JSON.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise GatewayError.invalid(f"{what} is not valid UTF-8.") from None
    except (ValueError, RecursionError) as e:
        raise GatewayError.invalid(f"{what} is not valid JSON: {e}.") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def dumps(obj: Any) -> str:
    """Compact JSON that keeps non-ASCII text as is (what every gateway sends)."""
    return orjson.dumps(obj, option=_OPTIONS).decode()


def dump_bytes(obj: Any) -> bytes:
    """`dumps` as UTF-8 bytes, for writing to a transport."""
    return orjson.dumps(obj, option=_OPTIONS)


def sse_event(obj: Any) -> bytes:
    """One SSE event: `data: <json>` and a blank line."""
    return b"data: " + orjson.dumps(obj, option=_OPTIONS) + b"\n\n"


def sse_done() -> bytes:
    """OpenAI's end-of-stream sentinel."""
    return b"data: [DONE]\n\n"


def jsonline(obj: Any) -> bytes:
    """One JSON lines record."""
    return orjson.dumps(obj, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)
