"""aiohttp handler of `/ws` and `/api/ws`: one Connection per socket.

A Connection reads frames, starts one task per accepted prompt (one Generate call each), and
sends events through a single writer task that drains a bounded queue (a FanIn of
gateways.common.streaming): whatever events are ready when the writer runs go out together as
one JSON array, so no event waits for one that is not ready yet and no stream is ever buffered
whole (DESIGN.md principle 5). A refused frame's `[{"error"}]` always goes out on its own.
Per-socket state is bounded by the options: frame size, prompts per frame, prompts in flight,
queued events.

Cancellation: when the socket closes (the client closes it, the connection drops, the heartbeat
finds no pong, or the server shuts down), every prompt task is cancelled, and each one's
`finally` cancels its gRPC call; the core then aborts the engine request within one step.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import grpc
from aiohttp import WSCloseCode, WSMsgType, web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client
from gateways.common.core_client import CoreClient
from gateways.common.framing import dumps
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, FanIn
from gateways.ws import errors, schema, translate
from gateways.ws.config import SETTINGS_KEY, WsSettings

log = logging.getLogger(__name__)

ROUTES = ("/ws", "/api/ws")
SOCKETS_KEY = web.AppKey("ws_sockets", weakref.WeakSet[web.WebSocketResponse[bool]])

#: A queued outgoing item: an event (shares an array with the other ready events), or a whole
#: frame (a list, sent on its own).
Outgoing = dict[str, Any] | list[dict[str, Any]]


def add_routes(app: web.Application) -> None:
    """Register `/ws` and `/api/ws` on `app`, and close live sockets at shutdown."""
    app[SOCKETS_KEY] = weakref.WeakSet()
    for path in ROUTES:
        app.router.add_get(path, websocket)
    app.on_shutdown.append(close_sockets)


class Connection:
    """The state of one WebSocket: prompts in flight and the outgoing event queue.

    Args:
        ws: the prepared socket.
        client: the core client.
        settings: limits and generation defaults.
    """

    def __init__(self, ws: web.WebSocketResponse, client: CoreClient, settings: WsSettings):
        self.ws = ws
        self.client = client
        self.settings = settings
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.out: FanIn[Outgoing] = FanIn(maxsize=settings.max_queued_events)

    async def serve(self) -> None:
        """Read frames until the socket closes; then cancel everything this socket started."""
        writer = asyncio.create_task(self._write())
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    await self._on_frame(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    await self._refuse(GatewayError.invalid("Binary frames are not supported; send JSON text frames."))
                elif msg.type is WSMsgType.ERROR:
                    log.info("websocket closed with an error: %s", self.ws.exception() or msg.data)
                    break
        finally:
            tasks = [*self.tasks.values(), writer]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _refuse(self, err: GatewayError) -> None:
        await self.out.put([errors.render_in_stream(err)])

    async def _on_frame(self, text: str) -> None:
        s = self.settings
        try:
            body = schema.parse_frame(text, max_prompts=s.max_prompts_per_batch)
        except GatewayError as e:
            await self._refuse(e)
            return
        busy = next((p.request_id for p in body.prompts if p.request_id in self.tasks), None)
        if busy is not None:
            await self._refuse(
                GatewayError.invalid(
                    f"request_id: '{busy}' is already in flight on this socket; wait for its COMPLETE or ERROR "
                    "before sending it again. Nothing of this batch was started.",
                    param="request_id",
                )
            )
            return
        if len(self.tasks) + len(body.prompts) > s.max_in_flight_prompts:
            await self._refuse(
                GatewayError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prompts: {len(self.tasks)} prompts are in flight on this socket and the batch adds "
                    f"{len(body.prompts)}; at most {s.max_in_flight_prompts} may be in flight at once. "
                    "Nothing of this batch was started.",
                    param="prompts",
                )
            )
            return
        for item in body.prompts:
            request = translate.to_generate_request(body, item, s.defaults)
            state = translate.PromptState.start(body, item)
            self.tasks[item.request_id] = asyncio.create_task(self._run_prompt(request, state))

    async def _run_prompt(self, request: spb.GenerateRequest, state: translate.PromptState) -> None:
        stream: CoreStream | None = None
        try:
            try:
                stream = await CoreStream.open(self.client.generate(request))
                async for msg in stream:
                    for event in translate.to_events(msg, state):
                        await self.out.put(event)
                # COMPLETE waits for the call's clean end: the core stores the session before it
                # closes the call, so a client that resends the request_id on COMPLETE always
                # finds the session released.
                await self.out.put(translate.to_complete(state))
            except GatewayError as e:
                log.info("prompt %s: %s %s", state.request_id, e.code.name, e.message)
                await self.out.put(errors.render_in_stream(e, state.request_id, prompt=state.prompt))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("prompt %s failed", state.request_id)
                err = GatewayError(grpc.StatusCode.INTERNAL, "Internal error in the gateway; see its log.")
                await self.out.put(errors.render_in_stream(err, state.request_id))
        finally:
            if stream is not None:
                stream.cancel()
            self.tasks.pop(state.request_id, None)

    async def _write(self) -> None:
        """Send queued events: all that are ready go out as one array."""
        try:
            while True:
                for frame in _frames(await self.out.batch()):
                    await self.ws.send_str(dumps(frame))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the peer is gone: end the socket, which cancels the prompts
            log.info("websocket write failed (%s); closing", e)
            await self.ws.close(code=WSCloseCode.ABNORMAL_CLOSURE)


def _frames(items: list[Outgoing]) -> list[list[dict[str, Any]]]:
    """Group queued items into frames: consecutive events share an array; a list stays alone."""
    frames: list[list[dict[str, Any]]] = []
    events: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, list):
            if events:
                frames.append(events)
                events = []
            frames.append(item)
        else:
            events.append(item)
    if events:
        frames.append(events)
    return frames


async def websocket(request: web.Request) -> web.StreamResponse:
    """GET /ws, /api/ws: upgrade, then serve the batch protocol until the socket closes."""
    settings = request.app[SETTINGS_KEY]
    ws = web.WebSocketResponse(
        heartbeat=settings.heartbeat_seconds or None,
        max_msg_size=settings.max_frame_bytes,
    )
    if not ws.can_prepare(request).ok:
        return errors.render_before_stream(
            GatewayError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "This endpoint speaks the WebSocket batch protocol; connect with a WebSocket client.",
                reason=errors.UPGRADE_REQUIRED,
            )
        )
    await ws.prepare(request)
    sockets = request.app[SOCKETS_KEY]
    sockets.add(ws)
    try:
        await Connection(ws, core_client(request), settings).serve()
    finally:
        sockets.discard(ws)
    return ws


async def close_sockets(app: web.Application) -> None:
    """on_shutdown: close live sockets with 1001 Going Away (their prompts are cancelled)."""
    sockets = app[SOCKETS_KEY]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
