"""LMI HTTP handlers: parse, call the core, stream. Translation lives in translate.py and error
shapes in errors.py; these handlers only wire them to aiohttp and gRPC.

Routes (seed "LMI handlers Inference API Schema"; DJL-Serving's front end):
- `POST /invocations` and `POST /predictions/{model_name}`: the rolling-batch schema (default)
  or the dynamic-batch one (`--batching dynamic`); a body with `messages` is a chat completions
  request, served by the shared chat route (gateways.common.chat) with LMI's framing, finish
  reasons and status overrides.
- `GET /ping`: 200 while the core answers its health check with SERVING, 503 otherwise.

A rolling-batch request is answered in a `Dialect`: LMI's, DJL's TGI compatibility (--tgi-compat,
or a request spelling `stop` as TGI does), or TGI's own routes' (gateways.lmi.tgi_routes, which
share `answer_rolling`).

Streaming follows the first-message rule (gateways.common.streaming): the status is chosen
before the first byte, errors after it are written in-band, every record is written as it
arrives, and the gRPC calls are cancelled in `finally` (a client disconnect cancels the
handler).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client, read_json
from gateways.common.chat.route import handle_chat
from gateways.common.core_call import Delta
from gateways.common.fields import client_error
from gateways.common.framing import JSONLINES_CONTENT_TYPE, SSE_CONTENT_TYPE, Template, dumps, jsonline, sse_event
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, MergedStreams, collect, collect_all, open_all, relay
from gateways.lmi.config import SETTINGS_KEY, LmiSettings
from gateways.lmi.errors import (
    LMI_STATUS_OVERRIDES,
    PayloadError,
    dynamic_error,
    model_not_found,
    render_before_stream,
    render_in_stream,
)
from gateways.lmi.schema import GenerationParameters, adapters_of, is_chat_request, parse_dynamic, parse_rolling
from gateways.lmi.translate import (
    FINISH_REASONS,
    StreamRenderer,
    client_names,
    collect_messages,
    dynamic_delta,
    dynamic_line,
    render_dynamic,
    render_options,
    render_response,
    to_generate_request,
)

log = logging.getLogger(__name__)


def add_routes(app: web.Application) -> None:
    """Register the gateway's routes on `app`."""
    app.router.add_post("/invocations", invocations)
    app.router.add_post("/predictions/{model_name}", predictions)
    app.router.add_get("/ping", ping)


async def invocations(request: web.Request) -> web.StreamResponse:
    """`POST /invocations`."""
    return await _invoke(request, model=None)


async def predictions(request: web.Request) -> web.StreamResponse:
    """`POST /predictions/{model_name}`: 404 in the LMI error shape unless `model_name` is the
    served model (GetModelInfo.model_name)."""
    name = request.match_info["model_name"]
    dynamic = request.app[SETTINGS_KEY].dynamic
    try:
        info = await core_client(request).model_info()
    except GatewayError as e:
        return _fail(e, dynamic=dynamic)
    if name != info.model_name:
        return _fail(model_not_found(name, info.model_name), dynamic=dynamic)
    return await _invoke(request, model=name)


async def ping(request: web.Request) -> web.Response:
    """`GET /ping`: `{"status": "Healthy"}` (200) while the core is SERVING, else
    `{"status": "Unhealthy"}` (503)."""
    if await core_client(request).serving():
        return web.json_response({"status": "Healthy"})
    return web.json_response({"status": "Unhealthy"}, status=503)


async def _invoke(request: web.Request, *, model: str | None) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as e:
        return _fail(PayloadError(e.message), dynamic=settings.dynamic)
    if is_chat_request(body):
        return await handle_chat(
            request,
            body,
            framing="sse" if _sse(request, settings, settings.tgi_compat) else "jsonlines",
            finish_words=FINISH_REASONS,
            status_overrides=LMI_STATUS_OVERRIDES,
        )
    if settings.dynamic:
        return await _dynamic(request, settings, body, model)
    return await _rolling(request, settings, body, model)


def _fail(err: GatewayError, *, dynamic: bool = False) -> web.Response:
    """Log an error answered before the stream started and render it."""
    log.info("request failed: %s %s", err.code.name, err.message)
    return render_before_stream(err, dynamic=dynamic)


def _sse(request: web.Request, settings: LmiSettings, tgi_compat: bool) -> bool:
    """Whether a stream is framed as SSE: `Accept: text/event-stream` (or
    `application/jsonlines` for jsonlines) per request, else the `--output-formatter` option,
    else SSE under TGI compatibility and jsonlines otherwise (DJL's defaults)."""
    accept = request.headers.get("Accept", "")
    if SSE_CONTENT_TYPE in accept:
        return True
    if JSONLINES_CONTENT_TYPE in accept:
        return False
    if settings.output_formatter:
        return settings.output_formatter == "sse"
    return tgi_compat


# ------------------------------------------------------------------------------ rolling batch


@dataclass(frozen=True, slots=True)
class Dialect:
    """How a rolling-batch answer is shaped: LMI's, DJL's TGI compatibility, or TGI's own routes.

    Attributes:
        tgi_compat: TGI's token spelling and body shapes (translate.RenderOptions).
        tgi_router: TGI's own routes' shapes (translate.RenderOptions).
        sse: a stream is framed as SSE (else JSON lines).
        fail: the response for an error before the first byte.
        in_stream: the record that ends a stream failing after it started.
        array: TGI's routes only: the whole body is a one-element array (TGI's `POST /`).
    """

    tgi_compat: bool
    tgi_router: bool
    sse: bool
    fail: Callable[[GatewayError], web.Response]
    in_stream: Callable[[GatewayError], dict[str, Any]]
    array: bool = False


#: What huggingface_hub's clients put in their User-Agent (huggingface_hub/utils/_headers.py,
#: `_http_user_agent`: "...; hf_hub/<version>; ...").
HF_HUB_AGENT = "hf_hub/"


def lmi_dialect(request: web.Request, settings: LmiSettings, params: GenerationParameters) -> Dialect:
    """The dialect of a rolling-batch request on DJL's routes: TGI compatibility with
    --tgi-compat, when the request spells `stop` as a list, TGI's spelling (LMI's own `stop` is
    TensorRT-LLM's boolean; the `text-generation` client always sends the list), or when
    huggingface_hub's `InferenceClient` sends it (its User-Agent names `hf_hub/`; its body is
    LMI's own). A TGI client pointed at `/invocations` thus reads an answer it can parse instead
    of an empty stream: both read only SSE `data:` lines, so huggingface_hub's streams are SSE
    unless its request's Accept header asks for JSON lines, whatever --output-formatter says."""
    hf_hub = HF_HUB_AGENT in request.headers.get("User-Agent", "")
    tgi = settings.tgi_compat or isinstance(params.stop, list) or hf_hub
    sse = _sse(request, settings, tgi) or (hf_hub and JSONLINES_CONTENT_TYPE not in request.headers.get("Accept", ""))

    def in_stream(err: GatewayError) -> dict[str, Any]:
        return render_in_stream(err, tgi_compat=tgi)

    return Dialect(tgi_compat=tgi, tgi_router=False, sse=sse, fail=_fail, in_stream=in_stream)


async def _rolling(request: web.Request, settings: LmiSettings, body: Any, model: str | None) -> web.StreamResponse:
    try:
        req = parse_rolling(body)
    except GatewayError as e:
        return _fail(e)
    dialect = lmi_dialect(request, settings, req.parameters)
    try:
        (adapter,) = adapters_of(req, 1)
    except GatewayError as e:
        return _fail(e)
    return await answer_rolling(
        request, req.inputs, req.parameters, dialect, stream=bool(req.stream), model=model, adapter=adapter
    )


async def answer_rolling(
    request: web.Request,
    inputs: str,
    params: GenerationParameters,
    dialect: Dialect,
    *,
    stream: bool,
    model: str | None = None,
    adapter: str = "",
) -> web.StreamResponse:
    """Answer one rolling-batch request (checked `inputs` and `params`) in `dialect`: the whole
    body as JSON, or a stream of one record per token, framed as the dialect says.

    Errors go through the dialect: before the first byte as its `fail` response, after it as
    its `in_stream` record; a parameter the core refuses is named as the client spelled it
    (translate.client_names).
    """

    def named(err: GatewayError) -> GatewayError:
        return client_error(err, client_names(params))

    try:
        opts = render_options(
            inputs,
            params,
            stream=stream,
            tgi_compat=dialect.tgi_compat,
            tgi_router=dialect.tgi_router,
            array=dialect.array,
        )
        grpc_req = to_generate_request(inputs, params, opts, request_id=uuid.uuid4().hex, model=model, adapter=adapter)
    except GatewayError as e:
        return dialect.fail(e)
    client = core_client(request)
    if not opts.stream:
        try:
            result = render_response(collect_messages(await collect(client.generate(grpc_req))), opts)
        except GatewayError as e:
            return dialect.fail(named(e))
        return web.Response(text=dumps(result), content_type="application/json")

    try:
        # Streamed records read only each token's id and logprob, unless they list alternatives.
        core_stream = await CoreStream.open(client.generate(grpc_req, steps=not opts.top_tokens))
    except GatewayError as e:
        return dialect.fail(named(e))
    frame = sse_event if dialect.sse else jsonline
    render = record_renderer(StreamRenderer(opts), frame)

    def render_error(err: GatewayError) -> bytes:
        return frame(dialect.in_stream(named(err)))

    return await relay(
        request,
        core_stream,
        render,
        render_error,
        content_type=SSE_CONTENT_TYPE if dialect.sse else JSONLINES_CONTENT_TYPE,
        request_id=grpc_req.request_id,
    )


def record_renderer(renderer: StreamRenderer, frame: Callable[[Any], bytes]) -> Callable[[Delta], bytes]:
    """The framed records of each delta of one rolling-batch stream: `renderer.feed(msg)`'s
    records for a message; a plain decode step's record (`StreamRenderer.step_text`) filled
    into a Template of `plain_record` encoded once per request; the same bytes as framing the
    records of the message the step stands for (on TGI's routes the template also leaves the
    record's `index` open). Steps come only for a stream without top_tokens (the route asks
    for them only then)."""
    indexed = renderer.opts.tgi_router
    if indexed:  # `index` comes first in the record, so it is the first value

        def indexed_record(index: Any, token_id: Any, text: Any, logprob: Any) -> bytes:
            return frame(renderer.plain_record(token_id, text, logprob, index))

        plain = Template(indexed_record, 4)
    else:
        plain = Template(lambda *values: frame(renderer.plain_record(*values)), 3)

    def render(delta: Delta) -> bytes:
        if type(delta) is tuple:
            text, token_id, logprob = delta
            text = renderer.step_text(text)
            if indexed:
                return plain.fill(renderer.index, token_id, text, logprob)
            return plain.fill(token_id, text, logprob)
        records = renderer.feed(cast(spb.GenerateResponse, delta))
        return frame(records[0]) if len(records) == 1 else b"".join(map(frame, records))

    return render


# ------------------------------------------------------------------------------ dynamic batch


async def _dynamic(request: web.Request, settings: LmiSettings, body: Any, model: str | None) -> web.StreamResponse:
    try:
        req = parse_dynamic(body)
        params = req.parameters
        inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        stream = req.stream if req.stream is not None else settings.enable_streaming
        request_id = uuid.uuid4().hex
        adapters = adapters_of(req, len(inputs))
        grpc_reqs = [
            to_generate_request(
                text,
                params,
                render_options(text, params, stream=False, tgi_compat=False),
                request_id=f"{request_id}-{i}",
                model=model,
                dynamic=True,
                adapter=adapters[i],
            )
            for i, text in enumerate(inputs)
        ]
    except GatewayError as e:
        return _fail(e, dynamic=True)
    client = core_client(request)
    if not stream:
        try:
            results = [collect_messages(r) for r in await collect_all([client.generate(r) for r in grpc_reqs])]
        except GatewayError as e:
            return _fail(client_error(e, client_names(params)), dynamic=True)
        body_out = render_dynamic(results, full_text=bool(params.return_full_text))
        return web.Response(text=dumps(body_out), content_type="application/json")

    try:
        streams = await open_all([client.generate(r) for r in grpc_reqs])
    except GatewayError as e:
        return _fail(client_error(e, client_names(params)), dynamic=True)

    def render(batch: list[tuple[int, str]]) -> bytes:
        texts = [""] * len(streams)
        for i, text in batch:
            texts[i] += text
        return jsonline(dynamic_line(texts)) if any(texts) else b""

    def render_error(err: GatewayError) -> bytes:
        return jsonline(dynamic_error(client_error(err, client_names(params)))[1])

    return await relay(
        request,
        MergedStreams(streams, dynamic_delta),
        render,
        render_error,
        content_type=JSONLINES_CONTENT_TYPE,
        request_id=request_id,
    )
