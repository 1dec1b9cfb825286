"""Anthropic's Messages API on the OpenAI gateway: `POST /v1/messages` and `POST
/v1/messages/count_tokens` (docs/anthropic.md).

`handle_messages` is the whole path, as gateways.common.chat.route.handle_chat is for chat
completions: check (gateways.openai.messages_schema), translate through chat completions
(gateways.openai.messages_translate), call the core, answer a `message` object or an SSE
stream of Anthropic's named events, with errors in Anthropic's shape
(gateways.openai.messages_errors): a proper status before the core's first message, an
`event: error` after it. `handle_count_tokens` renders the same chat and counts its tokens with
the core's Tokenize.

Headers: `anthropic-version` and `anthropic-beta` are accepted and not checked (the shapes
served are those of anthropic-sdk-python 2.10.0); `x-api-key` is accepted as the API key
(gateways.common.auth). Responses carry `request-id` (Anthropic's header) and `x-request-id`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, cast

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing as wire
from gateways.common.app import core_client
from gateways.common.chat import translate as chat_translate
from gateways.common.core_call import Delta
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay
from gateways.openai import messages_errors as errors
from gateways.openai import messages_schema as schema
from gateways.openai import messages_translate as translate

log = logging.getLogger(__name__)


def _failed(err: GatewayError, message_id: str, headers: dict[str, str]) -> web.Response:
    err = translate.client_error(err)
    log.info("message %s failed: %s %s", message_id, err.code.name, err.message)
    response = errors.render_before_stream(err, message_id)
    response.headers.update(headers)
    return response


async def handle_messages(request: web.Request, body: Any, *, reasoning_parser: str = "") -> web.StreamResponse:
    """Answer one Messages request.

    Args:
        request: the aiohttp request (its app holds the core client).
        body: the parsed JSON body (any JSON value; a non-object is a 400).
        reasoning_parser: a name in gateways.common.reasoning.PARSERS, whose reasoning becomes
            thinking blocks; "" for none.

    Returns:
        A `message` object, an SSE stream (message_start, ping, content_block_start /
        content_block_delta / content_block_stop per block, message_delta, message_stop), or
        an error response `{"type": "error", "error": {"type", "message"}}`; after the stream
        started, an `event: error` with that object ends it.
    """
    message_id = f"msg_{uuid.uuid4().hex}"
    headers = {"request-id": message_id, "x-request-id": message_id}
    try:
        req = schema.parse_messages_request(body)
        generate_request = translate.to_generate_request(req, request_id=message_id)
        log.info("message %s: stream=%s", message_id, bool(req.stream))
        client = core_client(request)
        info = await client.model_info()
        state = translate.state_for(req, message_id=message_id, model=info.model_name, reasoning=reasoning_parser)
        if not req.stream:
            messages = await collect(client.generate(generate_request))
            reply = translate.to_message(messages, state, message_id=message_id)
            return web.json_response(reply, headers=headers, dumps=wire.dumps)
        steps = chat_translate.plain_deltas(state)
        stream = await CoreStream.open(client.generate(generate_request, steps=steps))
    except GatewayError as e:
        return _failed(e, message_id, headers)
    events = translate.EventStream(state, message_id)
    started = False

    def render(delta: Delta) -> bytes:
        nonlocal started
        if started:
            head = b""
        else:
            head = events.start()
            started = True
        if type(delta) is tuple:
            return head + events.text(delta[0])
        return head + events.message(cast(spb.GenerateResponse, delta))

    def render_error(err: GatewayError) -> bytes:
        in_band = errors.render_in_stream(translate.client_error(err), message_id)
        return translate.event("error", in_band)

    return await relay(
        request,
        stream,
        render,
        render_error,
        content_type=wire.SSE_CONTENT_TYPE,
        headers=headers,
        end=events.end,
        request_id=message_id,
    )


async def handle_count_tokens(request: web.Request, body: Any) -> web.Response:
    """Answer one count_tokens request: `{"input_tokens": N}`, the tokens of the prompt the
    same Messages request would have (its chat rendered by the core's chat template, with its
    tools), or an error in Anthropic's shape (404 for a model that is not served)."""
    request_id = f"msg_{uuid.uuid4().hex}"
    headers = {"request-id": request_id, "x-request-id": request_id}
    try:
        req = schema.parse_count_tokens_request(body)
        tokenize = translate.tokenize_request(req)
        client = core_client(request)
        info = await client.model_info()
        if req.model and req.model != info.model_name:
            raise GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model: The model '{req.model}' is not served here; this server serves '{info.model_name}'.",
                param="model",
                reason="MODEL_NOT_FOUND",
            )
        reply = await client.tokenize(tokenize)
    except GatewayError as e:
        return _failed(e, request_id, headers)
    return web.json_response({"input_tokens": len(reply.token_ids)}, headers=headers, dumps=wire.dumps)
