"""Hugging Face TGI's own routes on the LMI gateway, always on (they do not overlap DJL's):
text-generation-inference router/src/server.rs (3.x), so TGI's clients (`text-generation`,
`huggingface_hub.InferenceClient`) work against the base URL unchanged.

- `POST /generate`: TGI's `GenerateResponse` `{"generated_text", "details"?}`.
- `POST /generate_stream`: SSE, one `{"index", "token", "top_tokens"?, "generated_text": null,
  "details": null}` event per token; the last carries `generated_text` and, with `details`,
  TGI's StreamDetails `{finish_reason, generated_tokens, seed, input_length}`.
- `POST /`: either of them by the body's `stream` (TGI's `compat_generate`, where both clients
  post), the JSON body wrapped in a one-element array.
- `POST /tokenize`: TGI's list of `{id, text, start, stop}` (byte offsets) for `inputs`, from the
  core's Tokenize (translate.tgi_tokens).
- `GET /info`: TGI's `Info` (translate.tgi_info). `GET /health` and `GET /`: 200 with no body
  while the core is SERVING, else 503 `{"error": "unhealthy", "error_type": "healthcheck"}`.
- `POST /v1/chat/completions`, `POST /v1/completions`: TGI's OpenAI-compatible routes, served by
  the OpenAI gateway's handlers (gateways.common.chat.route, gateways.common.chat.completion_route)
  with OpenAI's shapes and errors.

Requests are LMI's rolling-batch body (gateways.lmi.schema), whose parameters include every
field of TGI's `GenerateParameters`, translated by gateways.lmi.translate with TGI's defaults
(`details` off, `do_sample: false` not forcing greedy decoding, max_new_tokens from the core).
`/generate` and `/generate_stream` ignore a body's `stream`, as TGI does. Errors are TGI's
`{"error", "error_type"}` (gateways.lmi.tgi_errors).
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import replace
from typing import Any

from aiohttp import web
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.app import core_client, read_json
from gateways.common.chat import errors as chat_errors
from gateways.common.chat.completion_route import handle_completion
from gateways.common.chat.route import handle_chat
from gateways.common.chat.schema import any_model
from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.lmi import tgi_errors
from gateways.lmi.config import SETTINGS_KEY
from gateways.lmi.routes import Dialect, answer_rolling
from gateways.lmi.schema import parse_rolling
from gateways.lmi.translate import tgi_info, tgi_tokens

log = logging.getLogger(__name__)


def add_routes(app: web.Application) -> None:
    """Register TGI's routes (module docstring) on `app`: tgi_errors.TGI_PATHS and
    tgi_errors.OPENAI_PATHS."""
    app.router.add_post("/", compat_generate)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/", health)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


def _fail(err: GatewayError) -> web.Response:
    log.info("TGI request failed: %s %s", err.code.name, err.message)
    return tgi_errors.render_before_stream(err)


#: TGI's own shapes: JSON or SSE, TGI's records and errors.
TGI_ROUTER = Dialect(tgi_compat=True, tgi_router=True, sse=True, fail=_fail, in_stream=tgi_errors.render_in_stream)
#: `POST /`: the same, with the whole body in a one-element array ("to match api-inference",
#: router/src/server.rs `compat_generate`; the `text-generation` client reads `payload[0]`).
TGI_COMPAT_ROUTE = replace(TGI_ROUTER, array=True)


async def generate(request: web.Request) -> web.StreamResponse:
    """`POST /generate`."""
    return await _generate(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """`POST /generate_stream`."""
    return await _generate(request, stream=True)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """`POST /`: `/generate_stream` when the body sets `stream: true`, else `/generate`."""
    return await _generate(request, stream=None)


async def _generate(request: web.Request, *, stream: bool | None) -> web.StreamResponse:
    try:
        req = parse_rolling(await read_json(request, json_only=True))
    except GatewayError as e:
        return _fail(e)
    dialect = TGI_ROUTER if stream is not None else TGI_COMPAT_ROUTE
    streamed = bool(req.stream) if stream is None else stream
    return await answer_rolling(request, req.inputs, req.parameters, dialect, stream=streamed)


async def tokenize(request: web.Request) -> web.Response:
    """`POST /tokenize`: the tokens of `inputs` with their text and byte offsets (TGI's
    GenerateRequest body; of the parameters only `truncate` applies, as in TGI)."""
    try:
        req = parse_rolling(await read_json(request, json_only=True))
        resp = await core_client(request).tokenize(spb.TokenizeRequest(text=req.inputs))
    except GatewayError as e:
        return _fail(client_error(e, {"text": "inputs"}))
    return tgi_errors.json_response(200, tgi_tokens(req.inputs, resp, req.parameters.truncate))


async def health(request: web.Request) -> web.Response:
    """`GET /health` (and `GET /`): TGI's health check."""
    if await core_client(request).serving():
        return web.Response(status=200)
    return tgi_errors.json_response(503, tgi_errors.error_body("unhealthy", "healthcheck"))


async def info(request: web.Request) -> web.Response:
    """`GET /info`: TGI's Info object for the served model."""
    try:
        model = await core_client(request).model_info()
    except GatewayError as e:
        return _fail(e)
    return tgi_errors.json_response(200, tgi_info(model, _version()))


def _version() -> str:
    try:
        return importlib.metadata.version("trellis")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`: the OpenAI gateway's chat route (SSE, OpenAI's finish
    reasons and errors), as TGI serves it."""
    body: Any
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as err:
        return chat_errors.render_before_stream(err)
    if request.app[SETTINGS_KEY].accept_any_model:
        body = any_model(body)
    return await handle_chat(request, body)


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: the OpenAI gateway's completions route."""
    try:
        body = await read_json(request)
    except GatewayError as err:
        return chat_errors.render_before_stream(err)
    if request.app[SETTINGS_KEY].accept_any_model:
        body = any_model(body)
    return await handle_completion(request, body)
