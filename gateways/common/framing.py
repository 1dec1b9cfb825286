"""Wire framing shared by the gateways: JSON, Server-Sent Events and JSON lines, as bytes."""

from __future__ import annotations

import json
from typing import Any

SSE_CONTENT_TYPE = "text/event-stream"
JSONLINES_CONTENT_TYPE = "application/jsonlines"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    """Compact JSON that keeps non-ASCII text as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> bytes:
    """One SSE event: `data: <json>` and a blank line."""
    return f"data: {dumps(obj)}\n\n".encode()


def sse_done() -> bytes:
    """OpenAI's end-of-stream sentinel."""
    return b"data: [DONE]\n\n"


def jsonline(obj: Any) -> bytes:
    """One JSON lines record."""
    return (dumps(obj) + "\n").encode()
