"""aiohttp handlers of the OpenAI gateway: `POST /v1/chat/completions`, `GET /v1/models`,
`GET /v1/models/{model}`, `GET /health`.

Shared with the LMI gateway: `handle_chat(request, body, framing=..., finish_reasons=...)` is
the whole chat completions path (check, translate, call the core, answer streaming or not,
errors in OpenAI's shape). The LMI gateway calls it for `POST /invocations` when the body has
`messages`, with `framing="jsonlines"` and `finish_reasons="lmi"` (seed
`lmi-chat-completions-schema.md`); this gateway calls it with the defaults.

Streaming follows the first-message rule (`CoreStream.open` before `prepare()`): anything that
fails before the core's first message is a proper status with the error body; after it the
error goes in-band. `gateways.common.streaming.relay` writes each Generate message's chunks as
they arrive and cancels the gRPC call in a `finally`, so a client that disconnects (aiohttp
then cancels the handler) cancels the core's request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing as wire
from gateways.common.app import core_client, error_middleware
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay
from gateways.openai import errors, schema, translate

log = logging.getLogger(__name__)

FRAMINGS = ("sse", "jsonlines")
CREATED_KEY = web.AppKey("openai_created", int)


def encode(chunks: list[dict[str, Any]], framing: str) -> bytes:
    """Chunk objects on the wire: SSE `data: <json>` events, or one JSON object per line."""
    frame = wire.sse_event if framing == "sse" else wire.jsonline
    if len(chunks) == 1:  # the usual case: one choice with news per message
        return frame(chunks[0])
    return b"".join(map(frame, chunks))


def end_of_stream(framing: str) -> bytes:
    """What closes a stream: `data: [DONE]` on SSE, nothing on jsonlines."""
    return wire.sse_done() if framing == "sse" else b""


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions` (OpenAI SSE framing and finish reasons)."""
    try:
        body = wire.loads(await request.read())
    except GatewayError as err:
        return errors.render_before_stream(err)
    return await handle_chat(request, body)


async def handle_chat(
    request: web.Request,
    body: Any,
    *,
    framing: str = "sse",
    finish_reasons: str = "openai",
    status_overrides: Mapping[grpc.StatusCode, int] | None = None,
) -> web.StreamResponse:
    """Answer one chat completion request (shared by this gateway and LMI `/invocations`).

    Args:
        request: the aiohttp request (its app holds the core client).
        body: the already-parsed JSON body (any JSON value; a non-object is a 400).
        framing: "sse" (OpenAI: `text/event-stream`, `data: <chunk>` events, then
            `data: [DONE]`) or "jsonlines" (LMI: `application/jsonlines`, one chunk object per
            line, no [DONE]). Only used when the body asks for `stream`.
        finish_reasons: "openai" (`stop`, `length`) or "lmi" (`eos_token`, `stop_sequence`,
            `length`).
        status_overrides: gRPC code -> HTTP status entries that replace
            `gateways.common.status.GRPC_TO_HTTP` ones (e.g. LMI's 503 for RESOURCE_EXHAUSTED).

    Returns:
        A `chat.completion` JSON response, a streamed response of `chat.completion.chunk`
        objects, or an error response `{"error": {message, type, param, code}}` with the status
        from DESIGN.md's table. After the stream started, an error is sent in-band as
        `{"error": ...}` (then `data: [DONE]` on SSE).

    Raises:
        ValueError: `framing` or `finish_reasons` is not one of the values above.
    """
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {FRAMINGS}, got {framing!r}")
    if finish_reasons not in translate.FINISH_REASONS:
        raise ValueError(f"finish_reasons must be one of {sorted(translate.FINISH_REASONS)}, got {finish_reasons!r}")
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    headers = {"x-request-id": completion_id}
    req: schema.ChatCompletionRequest | None = None
    try:
        req = schema.parse_chat_request(body)
        generate_request = translate.to_generate_request(req, request_id=completion_id)
        log.info("chat completion %s: stream=%s n=%s user=%s", completion_id, bool(req.stream), req.n or 1, req.user)
        client = core_client(request)
        info = await client.model_info()
        state = translate.state_for(
            req, completion_id=completion_id, created=created, model=info.model_name, finish_reasons=finish_reasons
        )
        if req.stream:
            stream = await CoreStream.open(client.generate(generate_request))
        else:
            messages = await collect(client.generate(generate_request))
            return web.json_response(translate.to_completion(messages, state), headers=headers, dumps=wire.dumps)
    except GatewayError as err:
        err.param = translate.to_openai_param(err.param, req)
        log.info("chat completion %s failed: %s %s (param %s)", completion_id, err.code.name, err.message, err.param)
        response = errors.render_before_stream(err, status_overrides)
        response.headers.update(headers)
        return response

    def render(msg: spb.GenerateResponse) -> bytes:
        chunks = translate.to_chunks(msg, state)
        return encode(chunks, framing) if chunks else b""

    def end() -> bytes:
        usage = encode([translate.usage_chunk(state)], framing) if state.include_usage else b""
        return usage + end_of_stream(framing)

    def render_error(err: GatewayError) -> bytes:
        err.param = translate.to_openai_param(err.param, req)
        return encode([errors.render_in_stream(err, status_overrides)], framing) + end_of_stream(framing)

    return await relay(
        request,
        stream,
        render,
        render_error,
        content_type=wire.SSE_CONTENT_TYPE if framing == "sse" else wire.JSONLINES_CONTENT_TYPE,
        headers=headers,
        end=end,
        request_id=completion_id,
    )


async def list_models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model in OpenAI's list shape."""
    try:
        info = await core_client(request).model_info()
    except GatewayError as err:
        return errors.render_before_stream(err)
    return web.json_response({"object": "list", "data": [_model_card(request, info)]}, dumps=wire.dumps)


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: the served model's card, or 404 for any other name."""
    try:
        info = await core_client(request).model_info()
    except GatewayError as err:
        return errors.render_before_stream(err)
    name = request.match_info["model"]
    if name != info.model_name:
        return errors.error_response(
            404,
            f"The model '{name}' does not exist; this server serves '{info.model_name}'.",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(request, info), dumps=wire.dumps)


def _model_card(request: web.Request, info: spb.GetModelInfoResponse) -> dict[str, Any]:
    return {"id": info.model_name, "object": "model", "created": request.app[CREATED_KEY], "owned_by": "trellis"}


async def health(request: web.Request) -> web.Response:
    """`GET /health`: 200 while the core reports SERVING, 503 otherwise."""
    if await core_client(request).serving():
        return web.json_response({"status": "serving"})
    return web.json_response({"status": "not_serving"}, status=503)


#: Routing and body-size failures (404, 405, 413) in OpenAI's error shape.
openai_error_middleware = error_middleware(errors.error_response)


def add_routes(app: web.Application) -> None:
    """Register the gateway's routes on `app`."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_get("/health", health)
