"""aiohttp handler of `/ws` and `/api/ws`: one Connection per socket.

A Connection reads frames and starts one Generate request per accepted prompt, with no task per
prompt: the core client hands each prompt's messages to the Connection as they arrive (one core
message per engine step carries every prompt's news), they are rendered into events at once,
and after the core message the events of every prompt of the socket go out as one JSON array in
one text frame, so no event waits for one that is not ready yet and no stream is ever buffered
whole. While the client reads slower than events come (the connection
is paused), events wait and go out merged into one array when it takes more; a socket whose
client stops reading is closed once more than --max-queued-events wait. A refused frame's
`[{"error"}]` always goes out on its own. Per-socket state is bounded by the options: frame
size, prompts per frame, prompts in flight, queued events.

Cancellation: when the socket closes (the client closes it, the connection drops, the heartbeat
finds no pong, or the server shuts down), every prompt's request is cancelled; the core then
aborts the engine request within one step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import weakref
from typing import Any, cast

import grpc
from aiohttp import WSCloseCode, WSMsgType, web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client
from gateways.common.core_call import CoreCall
from gateways.common.core_client import CONFIG_KEY, CoreClient
from gateways.common.framing import Template, dump_bytes
from gateways.common.status import GatewayError
from gateways.common.tenant import current_tenant
from gateways.common.tracing import upgrade_parent
from gateways.common.writer import ResponseWriter
from gateways.ws import errors, schema, translate
from gateways.ws.config import SETTINGS_KEY, WsSettings

log = logging.getLogger(__name__)

ROUTES = ("/ws", "/api/ws")
SOCKETS_KEY = web.AppKey("ws_sockets", weakref.WeakSet[web.WebSocketResponse[bool]])

#: A queued outgoing item: an event, as an object or already encoded (it shares an array with
#: the other ready events), or a whole frame (a list, sent on its own).
Outgoing = dict[str, Any] | bytes | list[dict[str, Any]]


def add_routes(app: web.Application) -> None:
    """Register `/ws` and `/api/ws` on `app`, and close live sockets at shutdown."""
    app[SOCKETS_KEY] = weakref.WeakSet()
    for path in ROUTES:
        app.router.add_get(path, websocket)
    app.router.add_get("/health", health)
    app.on_shutdown.append(close_sockets)


class Connection:
    """The state of one WebSocket: prompts in flight and the events waiting to be sent.

    Args:
        request: the upgraded request (its transport carries the frames).
        ws: the prepared socket.
        client: the core client.
        settings: limits and generation defaults.
    """

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, client: CoreClient, settings: WsSettings):
        self.ws = ws
        self.client = client
        self.settings = settings
        self.max_json_depth = request.app[CONFIG_KEY].max_json_depth
        self.tenant = current_tenant()
        self.tracing = client.tracing
        self.trace_parent = upgrade_parent(request)
        self.route = request.path
        self.prompts: dict[str, CoreCall] = {}
        self._writer = ResponseWriter(request, frames=True)
        self._out: list[Outgoing] = []
        self._flush_pending = False
        self._done = False
        self._drainer: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[bool] | None = None

    async def serve(self) -> None:
        """Read frames until the socket closes; then cancel everything this socket started."""
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    try:
                        self._on_frame(msg.data)
                    except Exception:  # a bug must cost this frame, not the socket's other prompts
                        log.exception("websocket frame failed")
                        self._refuse(
                            GatewayError(grpc.StatusCode.INTERNAL, "Internal error in the gateway; see its log.")
                        )
                elif msg.type is WSMsgType.BINARY:
                    self._refuse(GatewayError.invalid("Binary frames are not supported; send JSON text frames."))
                elif msg.type is WSMsgType.ERROR:
                    log.info("websocket closed with an error: %s", self.ws.exception() or msg.data)
                    break
        finally:
            calls, self.prompts = list(self.prompts.values()), {}
            for call in calls:
                call.cancel()
                if call.span is not None:
                    call.span.end()
            self._done = True
            if self._drainer is not None:
                self._drainer.cancel()

    def _refuse(self, err: GatewayError) -> None:
        self._queue([[errors.render_in_stream(err)]])

    def _on_frame(self, text: str) -> None:
        s = self.settings
        try:
            body = schema.parse_frame(text, max_prompts=s.max_prompts_per_batch, max_depth=self.max_json_depth)
        except GatewayError as e:
            self._refuse(e)
            return
        busy = next((p.request_id for p in body.prompts if p.request_id in self.prompts), None)
        if busy is not None:
            self._refuse(
                GatewayError.invalid(
                    f"request_id: '{busy}' is already in flight on this socket; wait for its COMPLETE or ERROR "
                    "before sending it again. Nothing of this batch was started.",
                    param="request_id",
                )
            )
            return
        if len(self.prompts) + len(body.prompts) > s.max_in_flight_prompts:
            self._refuse(
                GatewayError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prompts: {len(self.prompts)} prompts are in flight on this socket and the batch adds "
                    f"{len(body.prompts)}; at most {s.max_in_flight_prompts} may be in flight at once. "
                    "Nothing of this batch was started.",
                    param="prompts",
                )
            )
            return
        for item in body.prompts:
            request = translate.to_generate_request(body, item, s.defaults, self.tenant)
            state = translate.PromptState.start(body, item)
            progress = Template(lambda text, state=state: dump_bytes(translate.progress_event(state, text)))
            span = None
            if self.tracing is not None:
                span = self.tracing.prompt_span(self.trace_parent, self.route, item.request_id, request.model)
            call = self.client.generate(request, hash_key=item.request_id, steps=True, span=span)
            self.prompts[item.request_id] = call
            call.listen(functools.partial(self._on_news, call, state, progress))

    def _on_news(self, call: CoreCall, state: translate.PromptState, progress: Template) -> None:
        """Render a prompt's new deltas (and its end) into events, called as they arrive; plain
        decode steps (translate.step_progress) fill the prompt's PROGRESS `progress` template,
        encoded once per prompt."""
        events: list[Outgoing] = []
        done = call.ended
        try:
            for delta in call.take():
                if type(delta) is tuple:
                    text = translate.step_progress(delta[0], state)
                    if text is not None:
                        events.append(progress.fill_text(text))
                else:
                    events += translate.to_events(cast(spb.GenerateResponse, delta), state)
            if done:
                if call.error is not None:
                    raise call.error
                # COMPLETE follows the request's clean end: the core stores the session before
                # it ends the request, so a client that resends the request_id on COMPLETE
                # always finds the session released.
                events.append(translate.to_complete(state))
        except GatewayError as e:
            log.info("prompt %s: %s %s", state.request_id, e.code.name, e.message)
            events.append(errors.render_in_stream(e, state.request_id, prompt=state.prompt))
            done = True
        except Exception:
            log.exception("prompt %s failed", state.request_id)
            err = GatewayError(grpc.StatusCode.INTERNAL, "Internal error in the gateway; see its log.")
            events.append(errors.render_in_stream(err, state.request_id))
            done = True
        if done:
            call.cancel()
            if self.prompts.get(state.request_id) is call:
                del self.prompts[state.request_id]
            if call.span is not None:
                call.span.end()
        if events:
            self._queue(events)

    def _queue(self, items: list[Outgoing]) -> None:
        """Queue events to send once the news of this core message are all rendered."""
        self._out += items
        if len(self._out) > self.settings.max_queued_events:
            if self._closing is None:
                log.info("websocket: %d events wait for a client that does not read; closing", len(self._out))
                message = b"too many events waiting to be read"
                self._closing = asyncio.create_task(self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=message))
            self._out.clear()
            return
        if self._flush_pending or self._drainer is not None:
            return
        if len(self.prompts) <= 1 and not self._writer.paused:
            # No other prompt of the socket can add to this core message's frame.
            self._send()
            return
        self._flush_pending = True
        self.client.after_news(self._flush)

    def _flush(self) -> None:
        """Send what waits now, or, while the connection is paused, once it takes more."""
        self._flush_pending = False
        if self._done:
            return
        if not self._writer.paused:
            self._send()
        elif self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())

    def _send(self) -> None:
        """Write every waiting item, ready events together as one array per frame."""
        items, self._out = self._out, []
        if len(items) == 1 and isinstance(event := items[0], bytes):  # one encoded event: most frames
            self._write(_event_frame(event))
        else:
            self._write(b"".join(_text_frame(_array(frame)) for frame in _frames(items)))

    def _write(self, data: bytes) -> None:
        """Hand `data` to the connection unless it is closed or closing (the reader then ends
        the socket)."""
        if not self._writer.closed and not self.ws.closed:
            self._writer.write(data)

    async def _drain(self) -> None:
        try:
            while self._out:
                await self._writer.writable()
                if not self._writer.paused:
                    self._send()
        except ConnectionError:
            pass
        finally:
            self._drainer = None


def _text_frame(payload: bytes) -> bytes:
    """One unmasked, uncompressed WebSocket text frame (RFC 6455 section 5.2; a server never
    masks, and the socket negotiates no compression)."""
    n = len(payload)
    if n < 126:
        header = bytes((0x81, n))
    elif n < 0x10000:
        header = struct.pack("!BBH", 0x81, 126, n)
    else:
        header = struct.pack("!BBQ", 0x81, 127, n)
    return header + payload


def _event_frame(event: bytes) -> bytes:
    """The text frame of one encoded event: `_text_frame(_array([event]))`, without the join."""
    return _text_frame(b"[" + event + b"]")


def _array(events: list[dict[str, Any]] | list[dict[str, Any] | bytes]) -> bytes:
    """A frame's JSON array: `dump_bytes(events)`, with events that are encoded already as
    they are (orjson's compact array is its items' encodings joined by commas)."""
    return b"[" + b",".join(e if isinstance(e, bytes) else dump_bytes(e) for e in events) + b"]"


def _frames(items: list[Outgoing]) -> list[list[dict[str, Any]] | list[dict[str, Any] | bytes]]:
    """Group queued items into frames: consecutive events share an array; a list stays alone."""
    frames: list[list[dict[str, Any]] | list[dict[str, Any] | bytes]] = []
    events: list[dict[str, Any] | bytes] = []
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
        compress=False,  # events are small, and Connection writes its frames itself
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
        await Connection(request, ws, core_client(request), settings).serve()
    finally:
        sockets.discard(ws)
    return ws


async def health(request: web.Request) -> web.Response:
    """`GET /health`: `{"status": "serving"}` (200) while the core reports SERVING, else
    `{"status": "not_serving"}` (503), as on the OpenAI gateway."""
    if await core_client(request).serving():
        return web.json_response({"status": "serving"})
    return web.json_response({"status": "not_serving"}, status=503)


async def close_sockets(app: web.Application) -> None:
    """on_shutdown: close live sockets with 1001 Going Away (their prompts are cancelled)."""
    sockets = app[SOCKETS_KEY]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
