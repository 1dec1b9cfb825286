"""The Responses API routes of the OpenAI gateway: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items` (docs/openai.md, "Responses API").

`handle_create` follows the chat completions route (gateways.common.chat.route): check,
translate (gateways.openai.responses_translate), call the core, answer, with errors in OpenAI's
shape. A streamed response opens the core's stream before its status line (the first-message
rule of gateways.common.streaming), so a refused request is a proper 4xx/5xx; a failure after
the start is sent in-band as an `error` event, then `response.failed`. A finished response is
stored (unless `store` is false) before its last event or its body is sent, so a client can
retrieve or chain it as soon as it has it; and a response to be stored is not generated while
the store cannot be reached (503 `store_unavailable` before the core is asked).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, cast

import grpc
from aiohttp import web
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing as wire
from gateways.common.app import core_client
from gateways.common.chat import errors
from gateways.common.chat import translate as chat_translate
from gateways.common.core_call import Delta
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay
from gateways.openai import responses_translate as rt
from gateways.openai.responses_schema import ITEMS, ResponsesRequest, parse_responses_request
from gateways.openai.responses_store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

STORE_KEY = web.AppKey("response_store", ResponseStore)

#: `input_items` page sizes (OpenAI's `limit`: 1 to 100, default 20).
MAX_PAGE = 100
DEFAULT_PAGE = 20


def _not_found(response_id: str, param: str | None = None) -> GatewayError:
    return GatewayError(
        grpc.StatusCode.NOT_FOUND,
        f"Response with id '{response_id}' not found.",
        param=param,
        reason="PREVIOUS_RESPONSE_NOT_FOUND" if param else "NOT_FOUND",
    )


async def handle_create(request: web.Request, body: Any, *, reasoning_parser: str = "") -> web.StreamResponse:
    """Answer `POST /v1/responses`.

    Args:
        request: the aiohttp request (its app holds the core client and the store).
        body: the parsed JSON body (any JSON value; a non-object is a 400).
        reasoning_parser: a name in gateways.common.reasoning.PARSERS, whose reasoning becomes
            `reasoning` output items; "" for none.

    Returns:
        A `response` object, an SSE stream of Responses events (`stream: true`), or an error
        `{"error": {message, type, param, code}}` with the status of
        gateways.common.status.GRPC_TO_HTTP (404 for an unknown `previous_response_id`).
    """
    ids = rt.Ids(uuid.uuid4().hex)
    created = int(time.time())
    headers = {"x-request-id": ids.response}
    store = request.app[STORE_KEY]
    req: ResponsesRequest | None = None
    try:
        req = parse_responses_request(body)
        context: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await store.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            context = previous.context
        elif req.stored:
            await store.check()
        chat_req = rt.to_chat_request(req, ITEMS.validate_python(context))
        generate_request = chat_translate.to_generate_request(chat_req, request_id=ids.response)
        log.info("response %s: stream=%s previous=%s", ids.response, bool(req.stream), req.previous_response_id)
        client = core_client(request)
        info = await client.model_info()
        state = chat_translate.state_for(
            chat_req,
            completion_id=ids.key,
            created=created,
            model=info.model_name,
            finish_words=rt.FINISH_WORDS,
            reasoning=reasoning_parser,
        )
        response = rt.skeleton(req, ids=ids, created_at=created, model=info.model_name)
        if req.stream:
            steps = chat_translate.plain_deltas(state)
            stream = await CoreStream.open(client.generate(generate_request, steps=steps))
        else:
            messages = await collect(client.generate(generate_request))
            completion = chat_translate.to_completion(messages, state)
            out = rt.response_object(completion, response, ids, cast(pb.Usage, state.usage))
            await _keep(store, req, ids, context, out)
            return web.json_response(out, headers=headers, dumps=wire.dumps)
    except GatewayError as e:
        err = rt.in_client_terms(e, req)
        log.info("response %s failed: %s %s (param %s)", ids.response, err.code.name, err.message, err.param)
        resp = errors.render_before_stream(err)
        resp.headers.update(headers)
        return resp
    events = rt.ResponseEvents(response, ids)
    checked = req

    async def finish() -> None:
        out = events.complete(cast(pb.Usage, state.usage))
        await _keep(store, checked, ids, context, out)

    def render(item: Delta) -> bytes:
        if type(item) is tuple:
            if state.plain_text(0):
                return events.text(item[0])
            step = chat_translate.step_chunk(state, item[0])  # reasoning to split out
            return events.begin() if step is None else events.chunk(step)
        chunks = chat_translate.to_chunks(cast(spb.GenerateResponse, item), state)
        return b"".join(events.chunk(c) for c in chunks) or events.begin()

    def render_error(err: GatewayError) -> bytes:
        named = rt.in_client_terms(err, checked)
        return events.fail(named, named.http_status())

    return await relay(
        request,
        stream,
        render,
        render_error,
        content_type=wire.SSE_CONTENT_TYPE,
        headers=headers,
        end=events.end,
        finish=finish,
        request_id=ids.response,
    )


async def _keep(
    store: ResponseStore, req: ResponsesRequest, ids: rt.Ids, context: list[dict[str, Any]], out: dict[str, Any]
) -> None:
    """Store a finished response, unless the request said `store: false`."""
    if not req.stored:
        return
    items = req.items()
    own = [item.model_dump(exclude_none=True) for item in items]
    record = StoredResponse(
        response=out,
        input_items=rt.input_item_records(items, ids),
        context=[*context, *own, *out["output"]],
    )
    await store.put(record)


async def handle_retrieve(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`: the stored response, or 404 (also for one stored with `store:
    false`, or dropped from a full store)."""
    response_id = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        return errors.error_response(
            400, "Replaying a stored response as a stream is not supported by this server.", param="stream"
        )
    try:
        record = await _stored(request, response_id)
    except GatewayError as e:
        return errors.render_before_stream(e)
    return web.json_response(record.response, dumps=wire.dumps)


async def _stored(request: web.Request, response_id: str) -> StoredResponse:
    """The stored response.

    Raises:
        GatewayError: NOT_FOUND, or UNAVAILABLE when the store cannot be reached.
    """
    record = await request.app[STORE_KEY].get(response_id)
    if record is None:
        raise _not_found(response_id)
    return record


async def handle_delete(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`: `{"id", "object": "response", "deleted": true}`, or 404."""
    response_id = request.match_info["response_id"]
    try:
        if not await request.app[STORE_KEY].delete(response_id):
            raise _not_found(response_id)
    except GatewayError as e:
        return errors.render_before_stream(e)
    return web.json_response({"id": response_id, "object": "response", "deleted": True}, dumps=wire.dumps)


async def handle_input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items`: the request's own input items as a list object
    `{"object": "list", "data", "first_id", "last_id", "has_more"}`, with OpenAI's query
    parameters `limit` (1 to 100, default 20), `order` ("desc", the default, or "asc") and
    `after` (an item id: the page starts after it)."""
    response_id = request.match_info["response_id"]
    query = request.query
    try:
        limit = _limit(query.get("limit"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError.invalid(f"Invalid value for 'order': expected 'asc' or 'desc', got '{order}'.", "order")
        record = await _stored(request, response_id)
    except GatewayError as e:
        return errors.render_before_stream(e)
    items = record.input_items if order == "asc" else record.input_items[::-1]
    after = query.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            return errors.render_before_stream(
                GatewayError.invalid(f"Invalid value for 'after': no input item '{after}' in this response.", "after")
            )
        items = items[position + 1 :]
    page = items[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
    return web.json_response(body, dumps=wire.dumps)


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_PAGE
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PAGE:
        raise GatewayError.invalid(
            f"Invalid value for 'limit': expected an integer from 1 to {MAX_PAGE}, got '{text}'.", "limit"
        )
    return value
