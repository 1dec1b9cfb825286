"""LMI HTTP handlers: parse, call the core, stream. Translation lives in translate.py and error
shapes in errors.py; these handlers only wire them to aiohttp and gRPC.

Routes (seed "LMI handlers Inference API Schema"; DJL-Serving's front end):
- `POST /invocations` and `POST /predictions/{model_name}`: the rolling-batch schema (default)
  or the dynamic-batch one (`--batching dynamic`); a body with `messages` is a chat completions
  request, served by the OpenAI gateway's chat handler in the LMI chat flavour.
- `GET /ping`: 200 while the core answers its health check with SERVING, 503 otherwise.

Streaming follows the first-message rule (gateways.common.streaming): the status is chosen
before the first byte, errors after it are written in-band, every record is written as it
arrives, and the gRPC call is cancelled in `finally` (a client disconnect cancels the handler).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client, option
from gateways.common.core_client import CONFIG_KEY, CoreClient
from gateways.common.framing import JSONLINES_CONTENT_TYPE, SSE_CONTENT_TYPE, dumps, jsonline, loads, sse_event
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay, stream_response
from gateways.lmi.errors import (
    LMI_STATUS_OVERRIDES,
    PayloadError,
    dynamic_error,
    model_not_found,
    payload_too_large,
    render_before_stream,
    render_in_stream,
    with_lmi_param,
)
from gateways.lmi.schema import is_chat_request, parse_dynamic, parse_rolling
from gateways.lmi.translate import (
    StreamRenderer,
    collect_messages,
    dynamic_delta,
    dynamic_line,
    given_parameters,
    render_dynamic,
    render_options,
    render_response,
    to_generate_request,
)
from gateways.openai.routes import handle_chat

log = logging.getLogger(__name__)


async def invocations(request: web.Request) -> web.StreamResponse:
    """`POST /invocations`."""
    return await _invoke(request, model=None, dynamic=_dynamic_batching(request))


async def predictions(request: web.Request) -> web.StreamResponse:
    """`POST /predictions/{model_name}`: 404 in the LMI error shape unless `model_name` is the
    served model (GetModelInfo.model_name)."""
    name = request.match_info["model_name"]
    dynamic = _dynamic_batching(request)
    try:
        info = await core_client(request).model_info()
    except GatewayError as e:
        return _fail(e, dynamic=dynamic)
    if name != info.model_name:
        return _fail(model_not_found(name, info.model_name), dynamic=dynamic)
    return await _invoke(request, model=name, dynamic=dynamic)


async def ping(request: web.Request) -> web.Response:
    """`GET /ping`: `{"status": "Healthy"}` (200) while the core is SERVING, else
    `{"status": "Unhealthy"}` (503)."""
    if await core_client(request).serving():
        return web.json_response({"status": "Healthy"})
    return web.json_response({"status": "Unhealthy"}, status=503)


async def _invoke(request: web.Request, *, model: str | None, dynamic: bool) -> web.StreamResponse:
    try:
        body = await _read_json(request)
    except GatewayError as e:
        return _fail(e, dynamic=dynamic)
    if is_chat_request(body):
        return await _chat(request, body)
    if dynamic:
        return await _dynamic(request, body, model)
    return await _rolling(request, body, model)


async def _read_json(request: web.Request) -> Any:
    """The decoded body.

    Raises:
        GatewayError: above the size limit (413), or not JSON (PayloadError, 424).
    """
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise payload_too_large(request.app[CONFIG_KEY].max_body_bytes) from None
    try:
        return loads(raw)
    except GatewayError as e:
        raise PayloadError(e.message) from None


def _fail(err: GatewayError, *, dynamic: bool = False) -> web.Response:
    """Log an error answered before the stream started and render it."""
    log.info("request failed: %s %s", err.code.name, err.message)
    return render_before_stream(err, dynamic=dynamic)


def _dynamic_batching(request: web.Request) -> bool:
    return option(request, "batching") == "dynamic"


def _sse(request: web.Request) -> bool:
    """Whether a stream is framed as SSE: `Accept: text/event-stream` (or
    `application/jsonlines` for jsonlines) per request, else the `--output-formatter` option,
    else SSE under TGI compatibility and jsonlines otherwise (DJL's defaults)."""
    accept = request.headers.get("Accept", "")
    if SSE_CONTENT_TYPE in accept:
        return True
    if JSONLINES_CONTENT_TYPE in accept:
        return False
    formatter = option(request, "output_formatter")
    if formatter:
        return formatter == "sse"
    return bool(option(request, "tgi_compat"))


# ------------------------------------------------------------------------------ rolling batch


async def _rolling(request: web.Request, body: Any, model: str | None) -> web.StreamResponse:
    tgi_compat = bool(option(request, "tgi_compat"))
    try:
        req = parse_rolling(body)
        params = req.parameters
        opts = render_options(req.inputs, params, stream=bool(req.stream), tgi_compat=tgi_compat)
        grpc_req = to_generate_request(req.inputs, params, opts, request_id=uuid.uuid4().hex, model=model)
    except GatewayError as e:
        return _fail(e)
    given = given_parameters(params)
    client = core_client(request)
    if not opts.stream:
        try:
            result = render_response(collect_messages(await collect(client.generate(grpc_req))), opts)
        except GatewayError as e:
            return _fail(with_lmi_param(e, given))
        return web.Response(text=dumps(result), content_type="application/json")

    try:
        stream = await CoreStream.open(client.generate(grpc_req))
    except GatewayError as e:
        return _fail(with_lmi_param(e, given))
    sse = _sse(request)
    frame = sse_event if sse else jsonline
    renderer = StreamRenderer(opts)

    def render(msg: spb.GenerateResponse) -> bytes:
        records = renderer.feed(msg)
        return frame(records[0]) if len(records) == 1 else b"".join(map(frame, records))

    def render_error(err: GatewayError) -> bytes:
        return frame(render_in_stream(with_lmi_param(err, given), tgi_compat=tgi_compat))

    return await relay(
        request,
        stream,
        render,
        render_error,
        content_type=SSE_CONTENT_TYPE if sse else JSONLINES_CONTENT_TYPE,
        request_id=grpc_req.request_id,
    )


# ------------------------------------------------------------------------------ dynamic batch


async def _dynamic(request: web.Request, body: Any, model: str | None) -> web.StreamResponse:
    try:
        req = parse_dynamic(body)
        params = req.parameters
        inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        stream = req.stream if req.stream is not None else bool(option(request, "enable_streaming"))
        request_id = uuid.uuid4().hex
        grpc_reqs = [
            to_generate_request(
                text,
                params,
                render_options(text, params, stream=False, tgi_compat=False),
                request_id=f"{request_id}-{i}",
                model=model,
                dynamic=True,
            )
            for i, text in enumerate(inputs)
        ]
    except GatewayError as e:
        return _fail(e, dynamic=True)
    given = given_parameters(params)
    client = core_client(request)
    if not stream:
        try:
            results = [collect_messages(r) for r in await _collect_all(client, grpc_reqs)]
        except GatewayError as e:
            return _fail(with_lmi_param(e, given), dynamic=True)
        body_out = render_dynamic(results, full_text=bool(params.return_full_text))
        return web.Response(text=dumps(body_out), content_type="application/json")

    try:
        streams = await _open_all(client, grpc_reqs)
    except GatewayError as e:
        return _fail(with_lmi_param(e, given), dynamic=True)
    queue: asyncio.Queue[tuple[int, str | GatewayError | None]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    resp = stream_response(JSONLINES_CONTENT_TYPE)
    try:
        await resp.prepare(request)
        remaining = len(streams)
        while remaining:
            items = [await queue.get()]
            while not queue.empty():  # merge what the other inputs produced meanwhile into one step
                items.append(queue.get_nowait())
            texts = [""] * len(streams)
            error = None
            for i, item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, GatewayError):
                    error = error or item
                else:
                    texts[i] += item
            if any(texts):
                await resp.write(jsonline(dynamic_line(texts)))
            if error is not None:
                error = with_lmi_param(error, given)
                log.warning("request %s failed mid-stream: %s %s", request_id, error.code.name, error.message)
                await resp.write(jsonline(dynamic_error(error)[1]))
                break
        await resp.write_eof()
    except ConnectionResetError:
        log.info("request %s: the client went away", request_id)
    finally:
        for task in pumps:
            task.cancel()
        for s in streams:
            s.cancel()
    return resp


async def _pump(index: int, stream: CoreStream, queue: asyncio.Queue) -> None:
    """Forward one input's text deltas to the shared queue; None marks its end, a GatewayError
    its failure."""
    try:
        async for msg in stream:
            text = dynamic_delta(msg)
            if text:
                queue.put_nowait((index, text))
    except GatewayError as e:
        queue.put_nowait((index, e))
        return
    queue.put_nowait((index, None))


async def _collect_all(client: CoreClient, reqs: list[spb.GenerateRequest]) -> list[list[spb.GenerateResponse]]:
    """All inputs' streams, generated concurrently; the first failure cancels the others."""
    tasks = [asyncio.create_task(collect(client.generate(r))) for r in reqs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _open_all(client: CoreClient, reqs: list[spb.GenerateRequest]) -> list[CoreStream]:
    """Open every input's stream (first message received); on a failure, cancel the opened ones."""
    tasks = [asyncio.create_task(CoreStream.open(client.generate(r))) for r in reqs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, CoreStream):
                outcome.cancel()
        raise


# ------------------------------------------------------------------------------ chat


async def _chat(request: web.Request, body: dict) -> web.StreamResponse:
    """A chat completions body on /invocations: the OpenAI gateway's chat handler renders it,
    streamed as jsonlines unless the output formatter is SSE (seed
    `lmi-chat-completions-schema.md`), with LMI's finish reasons."""
    framing = "sse" if _sse(request) else "jsonlines"
    return await handle_chat(
        request, body, framing=framing, finish_reasons="lmi", status_overrides=LMI_STATUS_OVERRIDES
    )
