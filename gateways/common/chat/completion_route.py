"""`POST /v1/completions`: OpenAI's legacy completions over the core's Generate streams.

Each prompt of the request is one Generate call, all started at once. Non-streaming: the
complete streams become one `text_completion` object. Streaming (`stream: true`): SSE
`data: <chunk>` events as each prompt's messages arrive (merged by arrival when there are
several prompts), then the usage chunk when `stream_options.include_usage` is set, then
`data: [DONE]`. The first-message rule is the chat route's (gateways.common.streaming): a
failure before every call's first message is an HTTP status with OpenAI's error object; after
it the error goes in-band, followed by `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, cast

from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing as wire
from gateways.common.app import core_client
from gateways.common.chat import completion_translate as translate
from gateways.common.chat import errors
from gateways.common.chat.completion_schema import CompletionRequest, parse_completion_request
from gateways.common.chat.route import encode, end_of_stream, reported_model
from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.common.streaming import MergedStreams, collect_all, open_all, relay

log = logging.getLogger(__name__)


async def handle_completion(request: web.Request, body: Any) -> web.StreamResponse:
    """Answer one completions request (see the module docstring).

    Returns:
        A `text_completion` JSON response, an SSE stream of `text_completion` chunks, or an
        error response `{"error": {message, type, param, code}}` with the status of its gRPC code
        (gateways.common.status.GRPC_TO_HTTP).
    """
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    headers = {"x-request-id": completion_id}
    req: CompletionRequest | None = None
    try:
        req = parse_completion_request(body)
        generate_requests = translate.to_generate_requests(req, completion_id=completion_id)
        log.info(
            "completion %s: prompts=%d stream=%s n=%s",
            completion_id,
            len(generate_requests),
            bool(req.stream),
            req.n or 1,
        )
        client = core_client(request)
        info = await client.model_info()
        model = reported_model(generate_requests[0].model, info)
        state = translate.state_for(req, completion_id=completion_id, created=int(time.time()), model=model)
        calls = [client.generate(g) for g in generate_requests]
        if not req.stream:
            streams = await collect_all(calls)
            return web.json_response(translate.to_completion(streams, state), headers=headers, dumps=wire.dumps)
        opened = await open_all(calls)
    except GatewayError as e:
        err = client_error(e, translate.client_names(req), prefix=False)
        log.info("completion %s failed: %s %s (param %s)", completion_id, err.code.name, err.message, err.param)
        response = errors.render_before_stream(err)
        response.headers.update(headers)
        return response
    names = translate.client_names(req)
    prompts = len(opened)

    def render(batch: list[tuple[int, spb.GenerateResponse]]) -> bytes:
        chunks = [c for prompt, msg in batch for c in translate.to_chunks(prompt, msg, state)]
        return encode(chunks, "sse") if chunks else b""

    def end() -> bytes:
        usage = encode([translate.usage_chunk(state, prompts)], "sse") if state.include_usage else b""
        return usage + end_of_stream("sse")

    def render_error(err: GatewayError) -> bytes:
        return encode([errors.render_in_stream(client_error(err, names, prefix=False))], "sse") + end_of_stream("sse")

    sse = wire.SSE_CONTENT_TYPE
    if prompts == 1:  # the usual case: the relay's pushed path, no task per message
        return await relay(
            request,
            opened[0],
            lambda msg: render([(0, cast(spb.GenerateResponse, msg))]),  # sent without steps
            render_error,
            content_type=sse,
            headers=headers,
            end=end,
            request_id=completion_id,
        )
    merged = MergedStreams(opened, lambda msg: msg)
    return await relay(
        request, merged, render, render_error, content_type=sse, headers=headers, end=end, request_id=completion_id
    )
