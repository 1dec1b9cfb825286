"""The chat completions route, shared by the OpenAI gateway (`POST /v1/chat/completions`) and the
LMI gateway (`POST /invocations` with a `messages` body, seed `lmi-chat-completions-schema.md`).

`handle_chat` is the whole path: check, translate, call the core, answer streaming or not, with
errors in OpenAI's shape. The gateways differ only in framing (SSE with `data: [DONE]`, or JSON
lines), finish-reason table and HTTP status overrides, which they pass in.

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
from collections.abc import Callable, Mapping
from typing import Any, cast

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing as wire
from gateways.common.app import core_client
from gateways.common.chat import errors, schema, translate
from gateways.common.core_call import Delta
from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay

log = logging.getLogger(__name__)

FRAMINGS = ("sse", "jsonlines")


def encode(chunks: list[dict[str, Any]], framing: str) -> bytes:
    """Chunk objects on the wire: SSE `data: <json>` events, or one JSON object per line."""
    frame = wire.sse_event if framing == "sse" else wire.jsonline
    if len(chunks) == 1:  # the usual case: one choice with news per message
        return frame(chunks[0])
    return b"".join(map(frame, chunks))


def chunk_renderer(state: translate.StreamState, framing: str) -> Callable[[Delta], bytes]:
    """The framed chunks of each delta of one stream: `encode(to_chunks(msg, state), framing)`
    for a message; for a plain decode step (which the route asks for only when
    `translate.plain_deltas(state)`), `translate.step_chunk`'s chunk, or, once the role went
    out and the text is plain content (`state.plain_text(0)`: no reasoning parser, or after
    the reasoning), its content delta filled into a Template of the chunk encoded once per
    request: the same bytes as to_chunks gives for the message the step stands for."""
    content = wire.Template(lambda value: encode([translate.content_chunk(state, 0, value)], framing))

    def render(delta: Delta) -> bytes:
        if type(delta) is tuple:
            text = delta[0]
            if text and 0 in state.role_sent and state.plain_text(0):
                return content.fill_text(text)
            chunk = translate.step_chunk(state, text)
            return b"" if chunk is None else encode([chunk], framing)
        chunks = translate.to_chunks(cast(spb.GenerateResponse, delta), state)
        return encode(chunks, framing) if chunks else b""

    return render


def end_of_stream(framing: str) -> bytes:
    """What closes a stream: `data: [DONE]` on SSE, nothing on jsonlines."""
    return wire.sse_done() if framing == "sse" else b""


async def handle_chat(
    request: web.Request,
    body: Any,
    *,
    framing: str = "sse",
    finish_words: Mapping[int, str] = translate.FINISH_REASONS,
    status_overrides: Mapping[grpc.StatusCode, int] | None = None,
    reasoning_parser: str = "",
    fill_context: bool = False,
) -> web.StreamResponse:
    """Answer one chat completion request.

    Args:
        request: the aiohttp request (its app holds the core client).
        body: the already-parsed JSON body (any JSON value; a non-object is a 400).
        framing: "sse" (OpenAI: `text/event-stream`, `data: <chunk>` events, then
            `data: [DONE]`) or "jsonlines" (LMI: `application/jsonlines`, one chunk object per
            line, no [DONE]). Only used when the body asks for `stream`.
        finish_words: the gateway's finish-reason table (OpenAI's `translate.FINISH_REASONS`, or
            LMI's); a finish reason without a word is an error (`finish_word`).
        status_overrides: gRPC code -> HTTP status entries that replace
            `gateways.common.status.GRPC_TO_HTTP` ones (e.g. LMI's 503 for RESOURCE_EXHAUSTED).
        reasoning_parser: a name in gateways.common.reasoning.PARSERS to answer the model's
            reasoning in `reasoning` apart from `content`; "" for none.
        fill_context: a request without max_tokens generates up to the rest of the context
            (translate.to_generate_request); False: the core's default applies.

    Returns:
        A `chat.completion` JSON response, a streamed response of `chat.completion.chunk`
        objects, or an error response `{"error": {message, type, param, code}}` with the status
        of gateways.common.status.GRPC_TO_HTTP. After the stream started, an error is sent in-band as
        `{"error": ...}` (then `data: [DONE]` on SSE).

    Raises:
        ValueError: `framing` is not one of FRAMINGS.
    """
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {FRAMINGS}, got {framing!r}")
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    headers = {"x-request-id": completion_id}
    req: schema.ChatCompletionRequest | None = None
    try:
        req = schema.parse_chat_request(body)
        generate_request = translate.to_generate_request(req, request_id=completion_id, fill_context=fill_context)
        log.info("chat completion %s: stream=%s n=%s user=%s", completion_id, bool(req.stream), req.n or 1, req.user)
        client = core_client(request)
        info = await client.model_info()
        state = translate.state_for(
            req,
            completion_id=completion_id,
            created=created,
            model=reported_model(generate_request.model, info),
            finish_words=finish_words,
            reasoning=reasoning_parser,
        )
        if req.stream:
            steps = translate.plain_deltas(state)
            stream = await CoreStream.open(client.generate(generate_request, steps=steps))
        else:
            messages = await collect(client.generate(generate_request))
            return web.json_response(translate.to_completion(messages, state), headers=headers, dumps=wire.dumps)
    except GatewayError as e:
        err = client_error(e, translate.client_names(req), prefix=False)
        log.info("chat completion %s failed: %s %s (param %s)", completion_id, err.code.name, err.message, err.param)
        response = errors.render_before_stream(err, status_overrides)
        response.headers.update(headers)
        return response
    render = chunk_renderer(state, framing)

    def end() -> bytes:
        usage = encode([translate.usage_chunk(state)], framing) if state.include_usage else b""
        return usage + end_of_stream(framing)

    def render_error(err: GatewayError) -> bytes:
        names = translate.client_names(req)  # only an error needs them
        in_band = errors.render_in_stream(client_error(err, names, prefix=False), status_overrides)
        return encode([in_band], framing) + end_of_stream(framing)

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


def reported_model(requested: str, info: spb.GetModelInfoResponse) -> str:
    """The `model` a response reports, as vLLM's server does: the name of the LoRA adapter a
    request chose by `model`, else the served model's first name (also for an alias, or for
    any name a gateway with --accept-any-model took)."""
    if requested and requested != info.model_name and requested not in info.model_aliases:
        return requested
    return info.model_name
