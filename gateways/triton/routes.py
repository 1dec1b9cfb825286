"""aiohttp handlers of the Triton gateway: generate, generate_stream, KServe v2 health and metadata.

Handlers are thin: check the URL's model and version, parse, translate (gateways.triton.translate),
call the core, render. Streaming follows the first-message rule (gateways.common.streaming): the
status is chosen before the first byte; afterwards errors go in-band (gateways.triton.errors).
Every Generate call is cancelled in a `finally` (`collect`, `relay`), so a client that
disconnects cancels its core request (handler cancellation is on).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import cast

from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client, read_json
from gateways.common.core_call import Delta
from gateways.common.framing import SSE_CONTENT_TYPE, Template, dumps, sse_event
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, collect, relay
from gateways.triton import errors, translate
from gateways.triton.config import SETTINGS_KEY
from gateways.triton.translate import ResponseRenderer, ServedModel

log = logging.getLogger(__name__)


def add_routes(app: web.Application) -> None:
    """Register every route of the gateway on `app`."""
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(base + "/generate", generate)
        app.router.add_post(base + "/generate_stream", generate_stream)
        app.router.add_get(base + "/ready", model_ready)
        app.router.add_get(base, model_metadata)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_metadata)


async def _served(request: web.Request) -> ServedModel:
    """The served model, from the core's (cached) GetModelInfo and the --model-version flag.

    Raises:
        GatewayError: the core cannot be reached (UNAVAILABLE -> 503).
    """
    info = await core_client(request).model_info()
    version = request.app[SETTINGS_KEY].model_version or info.model_version
    return ServedModel(name=info.model_name, version=version, engine=info.engine)


async def _target(request: web.Request) -> ServedModel:
    served = await _served(request)
    translate.check_target(request.match_info["model"], request.match_info.get("version"), served)
    return served


async def _generation_target(request: web.Request) -> tuple[ServedModel, str]:
    """The served model and the LoRA adapter a generate URL addresses: `/v2/models/<adapter>/...`
    names a registered adapter of the served model (its version is the served model's); any
    other name is checked as `_target` does. Returns (served, adapter or "").

    Raises:
        GatewayError: NOT_FOUND or INVALID_ARGUMENT (translate.check_target), UNAVAILABLE.
    """
    served = await _served(request)
    name = request.match_info["model"]
    if name != served.name:
        adapters = (await core_client(request).list_adapters()).adapters
        if any(a.name == name for a in adapters):
            translate.check_target(served.name, request.match_info.get("version"), served)
            return served, name
    translate.check_target(name, request.match_info.get("version"), served)
    return served, ""


async def _prepare(request: web.Request) -> tuple[translate.Translation, ResponseRenderer]:
    served, adapter = await _generation_target(request)
    body = await read_json(
        request, param="body", empty="The request body is empty; send a JSON object with 'text_input'."
    )
    tr = translate.to_generate_request(
        body,
        model=served.name,
        request_id=f"triton-{uuid.uuid4().hex}",
        ignore_unknown=request.app[SETTINGS_KEY].ignore_unknown_parameters,
    )
    if tr.ignored:
        log.debug("request %s: ignored unknown parameters %s", tr.request.request_id, ", ".join(tr.ignored))
    if adapter:
        if tr.request.adapter and tr.request.adapter != adapter:
            raise GatewayError.invalid(
                f"lora_name '{tr.request.adapter}' contradicts the adapter '{adapter}' the URL names.", "lora_name"
            )
        tr.request.adapter = adapter
    renderer = ResponseRenderer(adapter or served.name, served.version, client_id=tr.client_id, logprobs=tr.logprobs)
    return tr, renderer


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /v2/models/{model}[/versions/{version}]/generate: one `$generate_response` object."""
    names = None
    try:
        tr, renderer = await _prepare(request)
        names = tr.names
        messages = await collect(core_client(request).generate(tr.request))
    except GatewayError as e:
        return errors.render_before_stream(e, names)
    return web.json_response(renderer.response(messages), dumps=dumps)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """POST /v2/models/{model}[/versions/{version}]/generate_stream: SSE, one `data:` event per
    output delta, the last with finish_reason; an error after the start is a `data: {"error"}`
    event. There is no end-of-stream sentinel: the stream ends when the response ends."""
    names = None
    try:
        tr, renderer = await _prepare(request)
        names = tr.names
        stream = await CoreStream.open(core_client(request).generate(tr.request, steps=True))
    except GatewayError as e:
        return errors.render_before_stream(e, names)

    render = event_renderer(renderer)
    return await relay(
        request,
        stream,
        render,
        lambda err: errors.render_in_stream(err, names),
        content_type=SSE_CONTENT_TYPE,
        charset="utf-8",
        request_id=tr.request.request_id,
    )


def event_renderer(renderer: ResponseRenderer) -> Callable[[Delta], bytes]:
    """The SSE event of each delta of one stream (`renderer.event(msg)`, b"" for none), plain
    decode steps as `renderer.step_event`, filled into a Template of `text_event` encoded once
    per request while `renderer.plain_ready()`; the same bytes."""
    plain = Template(lambda text: sse_event(renderer.text_event(text)))

    def render(delta: Delta) -> bytes:
        if type(delta) is tuple:
            if renderer.plain_ready():
                return plain.fill_text(delta[0])
            return sse_event(renderer.step_event(delta[0], delta[2]))
        event = renderer.event(cast(spb.GenerateResponse, delta))
        return b"" if event is None else sse_event(event)

    return render


async def live(request: web.Request) -> web.Response:
    """GET /v2/health/live: 200 while the gateway process runs."""
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    """GET /v2/health/ready: 200 while the core reports SERVING, else 400 with an empty body
    (Triton's answer for "not ready"; KServe v2 asks for a 4xx)."""
    return web.Response(status=200 if await core_client(request).serving() else 400)


async def model_ready(request: web.Request) -> web.Response:
    """GET /v2/models/{model}[/versions/{version}]/ready: 200 (empty) when the model is served and
    the core is SERVING; 404/400 `{"error"}` for an unknown model or malformed version; 400
    `{"error": "Model version not ready ..."}` otherwise, as Triton answers."""
    try:
        await _target(request)
    except GatewayError as e:
        if e.http_status() in (400, 404):
            return errors.render_before_stream(e)
        return errors.error_response(400, f"Model version not ready: {e.message}")
    if not await core_client(request).serving():
        return errors.error_response(400, "Model version not ready: the model server is not serving.")
    return web.Response(status=200)


async def model_metadata(request: web.Request) -> web.Response:
    """GET /v2/models/{model}[/versions/{version}]: KServe v2 model metadata."""
    try:
        served = await _target(request)
    except GatewayError as e:
        return errors.render_before_stream(e)
    return web.json_response(translate.model_metadata(served), dumps=dumps)


async def server_metadata(request: web.Request) -> web.Response:
    """GET /v2: KServe v2 server metadata listing the generate extension."""
    return web.json_response(translate.server_metadata(request.app[SETTINGS_KEY].server_version), dumps=dumps)
