"""Error rendering of the `/ws` protocol (docs/websocket.md, "Errors").

A WebSocket has no status to set once upgraded, so there are two in-band shapes:
- a refused frame: `[{"error": "<sentence>"}]` (no request_id: nothing of the frame ran);
- a failed prompt: `{"request_id", "type": "ERROR", "error": "<sentence>"}` (the protocol's
  "Type ERROR"), sent in an event array; the socket stays open and the other prompts continue.
Before an upgrade the answer is an HTTP error response in the frame shape `[{"error"}]`: 426 for
a plain HTTP request to the route, 404/405 for any other path or method (the error middleware).

The sentence names this protocol's field when the core named one (`generation_config.num_beams:
...`), mapping the core's field paths through translate.FIELDS (gateways.common.fields).
"""

from __future__ import annotations

import grpc
from aiohttp import web

from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.ws.translate import ERROR, NAMES

UPGRADE_REQUIRED = "UPGRADE_REQUIRED"


def error_text(err: GatewayError, *, request_id: str | None = None, prompt: str | None = None) -> str:
    """The client-facing sentence for `err`.

    Args:
        err: the error (from the core or the gateway).
        request_id: the prompt it concerns, if any.
        prompt: that prompt's text, if any (an empty one explains a missing session).
    """
    if err.reason == "SESSION_BUSY" and request_id is not None:
        return (
            f"request_id: '{request_id}' is already generating on another connection; "
            "wait for its COMPLETE or ERROR before sending it again."
        )
    if err.param == "text" and prompt == "" and err.code is grpc.StatusCode.INVALID_ARGUMENT:
        return (
            f"prompt: the prompt is empty and there is no session for request_id '{request_id}' to continue; "
            "send a prompt."
        )
    return client_error(err, NAMES).message


def render_in_stream(err: GatewayError, request_id: str | None = None, *, prompt: str | None = None) -> dict[str, str]:
    """The in-band entry for `err`: a prompt's ERROR event, or `{"error"}` for a refused frame
    (request_id None). The caller sends it inside a JSON array."""
    text = error_text(err, request_id=request_id, prompt=prompt)
    if request_id is None:
        return {"error": text}
    return {"request_id": request_id, "type": ERROR, "error": text}


def render_http_error(request: web.Request, status: int, message: str) -> web.Response:
    """An HTTP-level error (unknown path 404, wrong method 405, a gateway failure 500) as
    `[{"error": msg}]`, for the error middleware (gateways.common.app)."""
    return web.json_response([{"error": message}], status=status)


def render_before_stream(err: GatewayError) -> web.Response:
    """An HTTP answer before the WebSocket upgrade: `[{"error"}]` with the status of err's code
    (426 Upgrade Required, with `Upgrade: websocket`, for a request that is not an upgrade)."""
    if err.reason == UPGRADE_REQUIRED:
        return web.json_response(
            [{"error": err.message}], status=426, headers={"Upgrade": "websocket", "Connection": "Upgrade"}
        )
    return web.json_response([{"error": err.message}], status=err.http_status())
