"""The gateway contract, and the aiohttp pieces every gateway shares.

A gateway is a package `gateways/<name>/` with the same modules, each with one responsibility:
`config.py` (its flags and its typed settings dataclass on an AppKey), `schema.py` (the JSON
shapes and types of its requests), `translate.py` (pure mapping to and from the Generate
contract, with the schema's field table and finish-reason table), `errors.py` (its error shapes),
`routes.py` (aiohttp handlers, registered by `add_routes`). The OpenAI gateway's schema,
translation and errors are gateways.common.chat's, as the LMI gateway speaks that schema too.
Its `__init__.py` is the `Gateway`
contract that `trellis-gateway <name>` runs: DEFAULT_PORT, add_arguments and make_app, which
builds the app with `make_gateway_app`.

Every app built so has: the gateway's settings on its AppKey, the core client
(`core_client(request)`), the body size limit, and the error middleware, so every error is in the
schema's own shape: those the handlers render themselves (they know the request), and those that
happen around them, rendered by the schema's `render_http_error`: an unknown path (404), a wrong
method (405), a body over --max-body-bytes (413), an unexpected failure before the response
started (500). And Prometheus metrics: `GET /metrics` and the middleware that counts every
request (gateways.common.metrics).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import ssl
import zlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from envflags import EnvArgumentParser
from envflags.apikeys import ApiKeys
from gateways.common.auth import HEALTH_PATHS, auth_middleware
from gateways.common.config import GatewayConfig
from gateways.common.connections import GuardedRunner, default_max_connections
from gateways.common.connections import install as install_accept_error_log
from gateways.common.core_client import CONFIG_KEY, CORE_CLIENT_KEY, CoreClient, core_client_ctx
from gateways.common.drain import SHUTDOWN_TIMEOUT_S
from gateways.common.framing import loads
from gateways.common.metrics import add_metrics, metrics_middleware
from gateways.common.openapi import OPENAPI_PATH, add_openapi
from gateways.common.status import GatewayError
from gateways.common.tenant import tenant_middleware
from gateways.common.tracing import TRACING_KEY, gateway_tracing, tracing_middleware

log = logging.getLogger(__name__)

S = TypeVar("S")

#: `render(request, status, message)`: a schema's response for an HTTP-level error.
HttpErrorRenderer = Callable[[web.Request, int, str], web.Response]

#: Set on a request once a response to it was prepared (its status line is sent).
RESPONSE_STARTED = web.RequestKey("trellis_response_started", bool)

INTERNAL_ERROR = "Internal error in the gateway; see its log."


class Gateway(Protocol):
    """What a gateway package exports (gateways/__main__.py runs it)."""

    DEFAULT_PORT: int

    def add_arguments(self, parser: EnvArgumentParser) -> None:
        """Add the gateway's own flags."""

    def make_app(self, config: GatewayConfig) -> web.Application:
        """The gateway's aiohttp application (see `make_gateway_app`).

        Raises:
            ValueError: a setting that cannot be used (e.g. a bad .env value).
        """


def make_gateway_app(
    config: GatewayConfig,
    settings_key: web.AppKey[S],
    settings: S,
    *,
    render_error: HttpErrorRenderer,
    add_routes: Callable[[web.Application], None],
    openapi: Callable[[GatewayConfig, S], dict[str, Any]],
) -> web.Application:
    """A gateway's app: config, settings (on `settings_key`), core client, body size limit, the
    error middleware with the schema's `render_error`, API keys (gateways.common.auth),
    Prometheus metrics (`GET /metrics`, gateways.common.metrics), OpenTelemetry request spans
    when tracing is on (gateways.common.tracing), the routes from
    `add_routes`, and `GET /openapi.json`: the document `openapi(config, settings)` builds,
    once, here (gateways.common.openapi).

    Raises:
        ValueError: --metrics-require-key without --api-key; tracing settings that
            oteltrace.resolve_tracing refuses.
    """
    middlewares = [metrics_middleware, error_middleware(render_error)]
    if config.metrics_require_key and not config.api_key:
        raise ValueError("--metrics-require-key needs --api-key")
    keys = ApiKeys(config.api_key) if config.api_key else None
    if keys is not None:
        open_paths = HEALTH_PATHS | {OPENAPI_PATH}
        if not config.metrics_require_key:
            open_paths |= {"/metrics"}
        middlewares.insert(1, auth_middleware(keys, render_error, open_paths=open_paths))
    middlewares.append(tenant_middleware(keys))
    tracing = gateway_tracing(config)
    if tracing is not None:  # outermost: its span sees the status the error middleware answers
        middlewares.insert(0, tracing_middleware(tracing))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG_KEY] = config
    if tracing is not None:
        app[TRACING_KEY] = tracing
        app.on_cleanup.append(_stop_tracing)
    app[settings_key] = settings
    app.cleanup_ctx.append(core_client_ctx)
    app.on_response_prepare.append(_mark_started)
    app.on_response_prepare.append(_retry_after)
    add_metrics(app)
    add_routes(app)
    add_openapi(app, openapi(config, settings))
    return app


async def _stop_tracing(app: web.Application) -> None:
    """Export the spans still batched before the app goes (blocking: on a thread)."""
    await asyncio.to_thread(app[TRACING_KEY].shutdown)


def core_client(request: web.Request) -> CoreClient:
    """The app's core client."""
    return request.app[CORE_CLIENT_KEY]


#: Bodies larger than this (bytes) are parsed on a thread (read_json).
OFF_LOOP_JSON_BYTES = 64 * 1024
_JSON_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="json")


async def read_json(
    request: web.Request, *, param: str | None = None, empty: str | None = None, json_only: bool = False
) -> Any:
    """The request body as strict JSON (framing.loads: NaN and Infinity, lone surrogates and
    nesting past --max-json-depth refused).

    Args:
        request: the request.
        param: the field to name in the errors (e.g. "body"), if any.
        empty: the message for a blank body; None treats it as invalid JSON.
        json_only: refuse a body that declares a Content-Type other than JSON
            (`application/json` or `application/*+json`) with 415; a body without a
            Content-Type is read as JSON (`check_json_content_type`).

    Raises:
        web.HTTPRequestEntityTooLarge: the body exceeds --max-body-bytes (the error middleware
            answers 413 in the schema's shape).
        web.HTTPUnsupportedMediaType: a non-JSON Content-Type with `json_only`, or a
            Content-Encoding other than gzip, deflate and identity (415, likewise).
        GatewayError: INVALID_ARGUMENT for a blank body (with `empty`), a body its
            Content-Encoding cannot decode, invalid UTF-8 or JSON.
    """
    if json_only:
        check_json_content_type(request)
    raw = await request.read()
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
    if encoding:
        # Inflating up to --max-body-bytes takes milliseconds; zlib does it without the GIL, so
        # a thread keeps it off the event loop, where several at once would stall every stream.
        raw = await asyncio.to_thread(decode_body, raw, encoding, param, request)
    if empty is not None and not raw.strip():
        raise GatewayError.invalid(empty, param)
    max_depth = request.app[CONFIG_KEY].max_json_depth
    try:
        if len(raw) <= OFF_LOOP_JSON_BYTES:
            return loads(raw, max_depth=max_depth)
        # Parsing and checking a large body (tens of thousands of small objects) takes tens of
        # milliseconds of Python; on a thread, the interpreter's switch interval (5 ms) gives
        # the event loop its turns meanwhile, so running streams do not stall behind it. One
        # thread for all: several parsing at once would each take a turn before the loop.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_JSON_THREAD, functools.partial(loads, raw, max_depth=max_depth))
    except GatewayError as e:
        if e.param is None:
            e.param = param
        raise


#: zlib's window bits for each Content-Encoding a body may have (RFC 9110 section 8.4.1):
#: gzip's wrapper, and for deflate the zlib wrapper (RFC 1950) or, as some clients send, gzip's.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": 32 + zlib.MAX_WBITS}


def decode_body(raw: bytes, encoding: str, param: str | None, request: web.Request) -> bytes:
    """A request body with its Content-Encoding undone, never more than --max-body-bytes.

    The server reads bodies without decoding them (`start_app`), so a body that expands past
    the limit costs no more than the limit to inflate, and a body the gateway refuses is never
    inflated at all.

    Args:
        raw: the body as received (at most --max-body-bytes, aiohttp's client_max_size).
        encoding: the Content-Encoding header: "", "identity", "gzip", "x-gzip", "deflate", or
            a comma-separated list of them, applied in order (so undone in reverse).
        param: the field to name in the errors.
        request: the request (for the limit).

    Raises:
        web.HTTPRequestEntityTooLarge: the decoded body exceeds the limit (413).
        web.HTTPUnsupportedMediaType: another coding, e.g. br or zstd (415, RFC 9110 section
            15.5.16).
        GatewayError: INVALID_ARGUMENT for data the coding cannot decode.
    """
    limit = request.app[CONFIG_KEY].max_body_bytes
    for coding in reversed([c.strip().lower() for c in encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        wbits = _WBITS.get(coding)
        if wbits is None:
            raise web.HTTPUnsupportedMediaType(
                text=f"The request body's Content-Encoding '{coding}' is not supported; send gzip, deflate or identity."
            )
        decoder = zlib.decompressobj(wbits)
        try:
            out = decoder.decompress(raw, limit + 1)
        except zlib.error as e:
            raise GatewayError.invalid(f"The request body could not be decoded as {coding}: {e}.", param) from None
        if len(out) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(out))
        if not decoder.eof or decoder.unused_data:
            raise GatewayError.invalid(
                f"The request body could not be decoded as {coding}: it is truncated or has trailing data.", param
            )
        raw = out
    return raw


def check_json_content_type(request: web.Request) -> None:
    """Refuse a body that declares a media type other than JSON.

    Accepted: no Content-Type header at all (what many hand-written clients send), and
    `application/json` or any `application/<x>+json`, with any parameters (charset).

    Raises:
        web.HTTPUnsupportedMediaType: with a sentence naming the type and the accepted ones.
    """
    if hdrs.CONTENT_TYPE not in request.headers:
        return
    ctype = request.content_type.lower()
    if ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json")):
        return
    raise web.HTTPUnsupportedMediaType(
        text=f"The request body is declared as '{ctype}'; send JSON with Content-Type: application/json."
    )


def error_middleware(render: HttpErrorRenderer) -> Middleware:
    """Render the errors that escape a handler with the schema's `render(request, status,
    message)`: aiohttp's HTTP errors (the message names the method and path for 404 and 405,
    "Not Found: GET /v2/nothing"; gives the limit for 413; is aiohttp's explanation otherwise),
    and any other exception as 500 when no response was started yet (after that the connection
    is closed, as aiohttp does). A 405 keeps aiohttp's `Allow` header."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = render(request, exc.status, _http_message(request, exc))
            if hdrs.ALLOW in exc.headers:  # a 405 lists the route's methods (RFC 9110 section 15.5.6)
                response.headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
            return response
        except Exception:
            if request.get(RESPONSE_STARTED):
                raise
            log.exception("%s %s failed", request.method, request.path)
            return render(request, 500, INTERNAL_ERROR)

    return middleware


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == web.HTTPRequestEntityTooLarge.status_code:
        return f"The request body is larger than the limit of {request.app[CONFIG_KEY].max_body_bytes} bytes."
    if exc.status in (404, 405) or exc.text in (None, f"{exc.status}: {exc.reason}"):
        return f"{exc.reason}: {request.method} {request.path}"
    return exc.text or exc.reason


async def _mark_started(request: web.Request, response: web.StreamResponse) -> None:
    request[RESPONSE_STARTED] = True


#: Statuses that tell a client to come back later: 429 (the core's queue is full) and 503 (the
#: core is unreachable, starting or draining; LMI's full queue, as DJL answers it).
RETRY_STATUSES = frozenset({429, 503})


async def _retry_after(request: web.Request, response: web.StreamResponse) -> None:
    """Add `Retry-After: <--retry-after-seconds>` to a 429 or 503 (RFC 9110 section 10.2.3),
    which openai-python and most HTTP clients honour before they retry."""
    if response.status in RETRY_STATUSES and hdrs.RETRY_AFTER not in response.headers:
        response.headers[hdrs.RETRY_AFTER] = str(request.app[CONFIG_KEY].retry_after_seconds)


class ClientProtocolErrors(logging.Filter):
    """On aiohttp's server logger: a request that cannot be parsed as HTTP/1.x (an HTTP/2
    preface, a malformed header line, a line over the limit) is answered 400 by aiohttp and is
    the client's fault, but aiohttp logs it with a traceback at ERROR (web_protocol
    `handle_error`, aiohttp 3.14; only a bad method on a fresh connection goes to DEBUG). Such a
    record becomes one INFO line naming the error, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            record.msg = (
                f"{record.getMessage()}: {type(exc).__name__} {exc.code}: {' '.join(exc.message.split())[:200]}"
            )
            record.args = ()
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True


_SERVER_LOG = logging.getLogger("aiohttp.server")

#: Seconds the server reads (and discards, undecoded) the rest of a body it did not read before
#: it closes the connection (`start_app`).
LINGER_S = 2.0


async def start_app(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Start serving `app` on host:port (0 picks a free port), over HTTPS with `ssl_context`;
    returns the runner and the port.

    Handler cancellation is on: a client that disconnects cancels its handler task at once, and
    the handler's `finally` cancels the gRPC call (the core then aborts the engine request).
    Requests that are not HTTP/1.x are logged in one line (`ClientProtocolErrors`).

    Bodies are read as received (`read_json` decodes them, bounded: `decode_body`), so a body
    the gateway refuses (401, 404, 405, 413) is never inflated. After a response to a request
    whose body was not read to its end, the server reads and discards the rest for at most
    LINGER_S (aiohttp's lingering close, 10 s by default), then closes the connection: closing
    at once would reset a client still sending, which can lose the response it is answered
    with. Idle keep-alive connections close after --keepalive-timeout; connections are capped at
    --max-connections, a first request's headers must be in within --header-timeout, and accept
    errors at the descriptor limit are logged at most once per --accept-error-log-interval
    (gateways.common.connections).
    """
    if not any(isinstance(f, ClientProtocolErrors) for f in _SERVER_LOG.filters):
        _SERVER_LOG.addFilter(ClientProtocolErrors())
    config = app[CONFIG_KEY]
    runner = GuardedRunner(
        app,
        max_connections=config.max_connections or default_max_connections(),
        header_timeout=config.header_timeout,
        retry_after=config.retry_after_seconds,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        auto_decompress=False,
        lingering_time=LINGER_S,
        keepalive_timeout=config.keepalive_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    server = site._server  # aiohttp exposes no public accessor for the bound port
    # An asyncio.Server, or uvloop's Server (not its subclass) on uvloop's loop: both have sockets.
    sockets = getattr(server, "sockets", None)
    assert sockets
    install_accept_error_log(app, list(sockets), config.accept_error_log_interval)
    return runner, int(sockets[0].getsockname()[1])
