"""The WebSocket gateway's OpenAPI document (`GET /openapi.json`, gateways.common.openapi).

OpenAPI describes HTTP exchanges, not the frames of a WebSocket. What it can hold is here: the
upgrade routes `GET /ws` and `GET /api/ws` with their HTTP answers (101 Switching Protocols for
a WebSocket handshake, 426 `[{"error"}]` for a plain request, 401 without a key), `GET /health`,
and the frames under the extension `x-websocket` of each upgrade operation: the client's text
frame (the pydantic model `WsRequest`, the protocol's "Queue generation payload") and the
server's frame, a JSON array of events. The events are built by hand in gateways.ws.translate
and errors.py; their schemas follow the protocol's "Service Response Events" (ACCEPTED, STARTED,
INITIALIZED, PROGRESS, COMPLETE, ERROR) and `[{"error"}]` for a refused frame
(docs/websocket.md).
"""

from __future__ import annotations

from typing import Any

from gateways.common import openapi as oa
from gateways.common.config import GatewayConfig
from gateways.ws.config import WsSettings
from gateways.ws.schema import WsRequest

_ID = {"type": "string", "description": "The prompt's request_id."}


def _event(kind: str, **fields: oa.Schema) -> oa.Schema:
    return {
        "type": "object",
        "required": ["request_id", "type", *fields],
        "properties": {"request_id": _ID, "type": {"const": kind}, **fields},
        "additionalProperties": False,
    }


#: One event of a server frame (seed "Service Response Events").
EVENT = {
    "oneOf": [
        _event("ACCEPTED"),
        _event("STARTED"),
        _event("INITIALIZED", text={"type": "string", "description": "The prompt, or '' with only_new_tokens."}),
        _event("PROGRESS", text={"type": "string", "description": "The newly generated text."}),
        _event(
            "COMPLETE",
            text={"type": "string"},
            is_eos={"type": "boolean"},
            new_tokens_count={"type": "integer", "minimum": 0},
            execution_time={"type": "number", "minimum": 0, "description": "Seconds."},
        ),
        _event("ERROR", error={"type": "string"}),
    ]
}

#: A refused frame, or an HTTP error before the upgrade: `[{"error"}]`.
FRAME_ERROR = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
}


def document(config: GatewayConfig, settings: WsSettings) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of the WebSocket gateway (a pure function of its settings)."""
    c = oa.Components()
    error = c.add("FrameError", FRAME_ERROR)
    frames = {
        "clientFrame": c.model(WsRequest),
        "serverFrame": {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [c.add("Event", EVENT), {"type": "object", "required": ["error"]}]},
        },
        "limits": {
            "maxFrameBytes": settings.max_frame_bytes,
            "maxPromptsPerFrame": settings.max_prompts_per_batch,
            "maxInFlightPrompts": settings.max_in_flight_prompts,
        },
    }
    upgrade = oa.responses(None, {426: error, 500: error})
    del upgrade["200"]
    upgrade["101"] = {
        "description": "Switching Protocols: the socket speaks the batch protocol; its frames are in x-websocket."
    }
    upgrade["426"]["headers"] = {"Upgrade": {"schema": {"const": "websocket"}}}
    paths: dict[str, Any] = {}
    for path in ("/ws", "/api/ws"):
        paths[path] = {
            "get": {
                "operationId": "websocket" if path == "/ws" else "apiWebsocket",
                "summary": "WebSocket upgrade (send `Upgrade: websocket` and the handshake headers of RFC 6455).",
                "responses": upgrade,
                "x-websocket": frames,
            }
        }
    paths["/health"] = oa.health_path("health", "serving", "not_serving")
    return oa.document(
        config,
        title="Trellis WebSocket gateway",
        description="The /ws batch protocol over the Trellis core (docs/websocket.md).",
        paths=paths,
        components=c,
        error=error,
        open_paths=("/health",),
    )
