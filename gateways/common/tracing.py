"""A gateway's OpenTelemetry spans (flags, variables and exporter: oteltrace).

With tracing on (`--otlp-traces-endpoint`, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), every HTTP
request gets a SERVER span named "{method} {route}" (OpenTelemetry's HTTP semantic conventions,
semantic-conventions 1.37, docs/http/http-spans.md) that continues the client's W3C
`traceparent` header, or starts a trace. It covers the request from its headers to its last
byte, and holds http.request.method, http.route, url.path, http.response.status_code and,
once a core call starts, gen_ai.request.model. A WebSocket is one long request, so its spans
are per prompt instead: "{route} prompt", a child of the upgrade request's `traceparent`,
from the prompt's frame to its COMPLETE or ERROR event.

The core call of a request carries the span on to the core (gateways.common.core_client):
as `traceparent` metadata of a Generate call, or as the start's `trace_context` on a
MultiplexGenerate stream, whose metadata is the stream's. The core's request span is then a
child of the gateway's (core.tracing).

Status ERROR: a response status of 500 or more (the HTTP conventions leave 4xx of a server span
unset), and a core call that ended with an error other than the client's own cancel, with the
error's reason (the core's, core.errors, or the gateway's own) as `error.type` and first word of
the description.

Health probes and metrics scrapes (`HEALTH_PATHS`, `/metrics`) get no span.

With tracing off the app holds no `GatewayTracing`, no middleware is added, and a core call
carries no span: a request costs nothing more.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateways.common.auth import HEALTH_PATHS
from gateways.common.config import GatewayConfig
from gateways.common.status import GatewayError
from oteltrace import TRACEPARENT, Tracing, parent_context, resolve_tracing, start_tracing

__all__ = ["TRACING_KEY", "GatewayTracing", "call_failed", "gateway_tracing", "tracing_middleware", "upgrade_parent"]

#: Spans' instrumentation scope.
SCOPE = "trellis.gateway"

#: Routes that get no span: probes and scrapes, which come every few seconds and say nothing of
#: a request's path.
UNTRACED = HEALTH_PATHS | {"/metrics"}

#: The parent context of a WebSocket's prompts: the upgrade request's `traceparent`, if any.
UPGRADE_PARENT = web.RequestKey("trellis_trace_parent", Context)


class GatewayTracing:
    """A gateway's tracer (one per app).

    Attributes:
        tracing: oteltrace's tracer and provider.
        tracer: makes the spans.
    """

    __slots__ = ("tracer", "tracing")

    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self.tracer = tracing.tracer

    def shutdown(self) -> None:
        """Export the spans still batched (blocking; see oteltrace.Tracing.shutdown)."""
        self.tracing.shutdown()

    def prompt_span(self, parent: Context | None, route: str, request_id: str, model: str) -> trace.Span:
        """A WebSocket prompt's span, started now (its owner ends it with `end_prompt`).

        Args:
            parent: the upgrade request's context (`upgrade_parent`), or None: a new trace.
            route: the socket's route ("/ws").
            request_id: the prompt's request id.
            model: the model it asks for ("": the served one).
        """
        attributes = {"http.route": route, "gen_ai.response.id": request_id}
        if model:
            attributes["gen_ai.request.model"] = model
        return self.tracer.start_span(f"{route} prompt", context=parent, kind=SpanKind.SERVER, attributes=attributes)


TRACING_KEY = web.AppKey("trellis_tracing", GatewayTracing)


def gateway_tracing(config: GatewayConfig) -> GatewayTracing | None:
    """The gateway's tracer when its settings turn tracing on (oteltrace.resolve_tracing), else
    None. Its service is "trellis-gateway-<name>" unless OTEL_SERVICE_NAME names one.

    Raises:
        ValueError: settings resolve_tracing refuses.
    """
    settings = resolve_tracing(config.otlp_traces_endpoint, config.otlp_traces_sample_ratio)
    if settings is None:
        return None
    return GatewayTracing(start_tracing(settings, f"trellis-gateway-{config.name}", SCOPE))


def upgrade_parent(request: web.Request) -> Context | None:
    """The context a WebSocket's prompt spans continue (the upgrade's `traceparent`), or None."""
    return request.get(UPGRADE_PARENT)


def tracing_middleware(tracing: GatewayTracing) -> Middleware:
    """The request span of every HTTP request (module docstring); the span is the current one
    while the handler runs, so the core call it makes carries it. A WebSocket upgrade gets no
    span of its own: its `traceparent` is kept for its prompts (`upgrade_parent`)."""
    tracer = tracing.tracer

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in UNTRACED:
            return await handler(request)
        parent = parent_context(request.headers.get(TRACEPARENT, ""))
        if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
            if parent is not None:
                request[UPGRADE_PARENT] = parent
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.path}
        with tracer.start_as_current_span(
            f"{request.method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                response = await handler(request)
            except web.HTTPException as e:  # below 400: the error middleware lets it through
                _status(span, e.status)
                raise
            except Exception as e:  # after its response started (the error middleware answers the rest)
                span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
                raise
            _status(span, response.status)
            return response

    return middleware


def _status(span: trace.Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    # A core call's failure (call_failed) already gave the reason; keep it.
    failed = getattr(span, "status", Status()).status_code is StatusCode.ERROR
    if status >= 500 and not failed:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))


def call_failed(span: trace.Span, error: GatewayError) -> None:
    """Mark `span` failed with a core call's `error` (CoreCall calls it when the transport ends
    the call with an error, or a gateway deadline does; never for its owner's own cancel)."""
    span.set_status(Status(StatusCode.ERROR, f"{error.reason}: {error.message}"))
    span.set_attribute("error.type", error.reason)
