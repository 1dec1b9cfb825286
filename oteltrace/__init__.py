"""OpenTelemetry tracing as both islands set it up: the flags, the exporter, the sampler, and
W3C Trace Context in and out.

Flags (vLLM's names, `vllm serve --otlp-traces-endpoint`): `--otlp-traces-endpoint URL` turns
tracing on and exports spans to that OTLP/HTTP (protobuf) receiver; a URL without a path gets
the signal's path `/v1/traces` (the OTLP specification's default). `--otlp-traces-sample-ratio R`
(0 to 1) samples that fraction of the traces a process starts, and follows the caller's
decision for the traces it continues: `ParentBased(TraceIdRatioBased(R))`.

The standard variables of the OpenTelemetry SDK's configuration
(opentelemetry-specification, "Environment Variable Specification") apply as the SDK reads
them: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT`, plus
`/v1/traces`) turns tracing on without the flag; `OTEL_TRACES_SAMPLER_ARG` is the ratio when
the flag is not given (with `OTEL_TRACES_SAMPLER` unset or a ratio sampler); `OTEL_SERVICE_NAME`
and `OTEL_RESOURCE_ATTRIBUTES` name the process; `OTEL_EXPORTER_OTLP_TRACES_HEADERS`,
`_TIMEOUT`, `_COMPRESSION` and `_CERTIFICATE` configure the exporter, `OTEL_BSP_*` the batch
span processor; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turns tracing off. A flag
wins over its variable.

Off (no endpoint), nothing of OpenTelemetry's SDK is loaded and the islands hold None where a
tracer would be, so serving a request costs one `is None` check. Spans go out through a
BatchSpanProcessor (a thread that exports in batches), never on the event loop.

This package is the only one both islands share that is not standard library only: it imports
opentelemetry-api, and the SDK and the OTLP/HTTP exporter when tracing is on.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "TRACEPARENT",
    "Tracing",
    "TracingSettings",
    "add_tracing_arguments",
    "parent_context",
    "resolve_tracing",
    "sample_ratio",
    "start_tracing",
    "traceparent_of",
]

#: The W3C Trace Context header (and gRPC metadata key) that carries the caller's span.
TRACEPARENT = "traceparent"

#: OTLP/HTTP's path for traces (opentelemetry-proto, docs/specification.md "OTLP/HTTP Request").
TRACES_PATH = "/v1/traces"

_PROPAGATOR = TraceContextTextMapPropagator()
_RATIO_SAMPLERS = frozenset({"traceidratio", "parentbased_traceidratio"})
_TRACEPARENT_SHAPE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def sample_ratio(raw: str) -> float:
    """`--otlp-traces-sample-ratio`: a float from 0 to 1.

    Raises:
        argparse.ArgumentTypeError: not a number, or outside [0, 1].
    """
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {raw!r}")
    return value


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--otlp-traces-endpoint` (default: none, tracing off unless the OTEL_* variables say
    otherwise) and `--otlp-traces-sample-ratio` (default: OTEL_TRACES_SAMPLER_ARG, else 1.0)."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        default="",
        help="export OpenTelemetry traces to this OTLP/HTTP URL (e.g. http://collector:4318/v1/traces; "
        "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing)",
    )
    parser.add_argument(
        "--otlp-traces-sample-ratio",
        type=sample_ratio,
        default=None,
        help="fraction of new traces sampled, 0 to 1; a caller's traceparent decides for its own trace "
        "(default: OTEL_TRACES_SAMPLER_ARG, else 1.0)",
    )


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where and how much to trace (`resolve_tracing`).

    Attributes:
        endpoint: the OTLP/HTTP URL spans are posted to (its path included).
        ratio: the sampled fraction of new traces, 0 to 1.
    """

    endpoint: str
    ratio: float


def _with_path(url: str) -> str:
    """`url`, with TRACES_PATH when it has no path of its own."""
    return url.rstrip("/") + TRACES_PATH if urlsplit(url).path in ("", "/") else url


def resolve_tracing(
    endpoint: str, ratio: float | None, environ: Mapping[str, str] | None = None
) -> TracingSettings | None:
    """The tracing a process runs with, from its flags and the OTEL_* variables (module
    docstring); None when tracing is off.

    Args:
        endpoint: `--otlp-traces-endpoint` ("" when not given).
        ratio: `--otlp-traces-sample-ratio` (None when not given).
        environ: the environment (default os.environ).

    Raises:
        ValueError: the endpoint is not an http:// or https:// URL, or OTEL_TRACES_SAMPLER_ARG
            (when it is the ratio) is not a number from 0 to 1.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if not endpoint and env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    url = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not url and env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        url = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + TRACES_PATH
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL, got {url!r}")
    if ratio is None:
        raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        ratio = 1.0
        if raw and (not sampler or sampler in _RATIO_SAMPLERS):
            try:
                ratio = sample_ratio(raw)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: {e}") from None
    return TracingSettings(endpoint=_with_path(url), ratio=ratio)


class Tracing:
    """A process's tracer and the provider that exports its spans (`start_tracing`).

    Attributes:
        tracer: creates the process's spans.
        provider: the SDK's provider; `shutdown()` exports what is left (blocking: call it off
            the event loop).
    """

    __slots__ = ("provider", "tracer")

    def __init__(self, provider: TracerProvider, tracer: trace.Tracer):
        self.provider = provider
        self.tracer = tracer

    def shutdown(self) -> None:
        """Export the spans still batched and stop the exporter's thread (blocks up to the
        exporter's timeout)."""
        self.provider.shutdown()


def start_tracing(settings: TracingSettings, service_name: str, scope: str) -> Tracing:
    """A provider of its own (not the global one, so several in one process stay apart) with
    the ratio sampler, a BatchSpanProcessor and the OTLP/HTTP exporter.

    Args:
        settings: `resolve_tracing`'s.
        service_name: the `service.name` resource attribute when OTEL_SERVICE_NAME does not set
            one ("trellis-core", "trellis-gateway-openai").
        scope: the instrumentation scope's name (the module creating the spans).
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(settings.ratio)), resource=Resource.create(attributes)
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    return Tracing(provider, provider.get_tracer(scope))


def parent_context(traceparent: str) -> Context | None:
    """The context of the caller's span that a W3C `traceparent` names, or None when it is
    empty or does not parse (the request then starts a trace of its own, as the W3C Trace
    Context specification asks of a receiver, section 3.2: "If the vendor failed to parse
    traceparent, it MUST NOT attempt to parse tracestate")."""
    if not traceparent or not _TRACEPARENT_SHAPE.match(traceparent.strip()):
        return None
    context = _PROPAGATOR.extract({TRACEPARENT: traceparent.strip()})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: trace.Span) -> str:
    """The W3C `traceparent` naming `span` ("00-<trace id>-<span id>-<flags>"); "" for a span
    without a valid context."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
