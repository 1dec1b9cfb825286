"""The core's OpenTelemetry spans of a request (flags, variables and exporter: oteltrace).

A request's spans are made once, when it ends, from the timestamps the pipeline already keeps
for its metrics (core.metrics: arrival, the lifecycle states, the last token): nothing is
created, looked up or measured per token, and with tracing off (`--otlp-traces-endpoint`
unset) the service holds None instead of a `CoreTracing` and no `RequestTrace` exists. The
one clock read a traced request adds is its receipt, where its core span starts.

The tree of one request, a child of the caller's span when it sent a W3C `traceparent` (gRPC
metadata on Generate, `GenerateRequest.trace_context` on MultiplexGenerate):

    {chat|text_completion} {model}   SERVER, receipt to the request's end
      tokenize                       receipt to admission: validation, chat template, tokenization
      queue                          admission to the engine taking it into its batch
      prefill                        into the batch until the prompt is processed
      decode                         the prompt processed until the last token; events
                                     `gen_ai.first_token` and `gen_ai.finish`

A stage the engine does not report (the mock engine's prefill) takes no time: the pipeline
fills its state in at the next one. Attributes follow the OpenTelemetry GenAI semantic
conventions (semantic-conventions 1.37, docs/gen-ai/gen-ai-spans.md): gen_ai.operation.name,
gen_ai.request.model (the served model when the request names none), gen_ai.request.max_tokens,
temperature and top_p where the request sets them, gen_ai.usage.input_tokens and
output_tokens, gen_ai.response.finish_reasons, gen_ai.response.id (the request id), and
gen_ai.server.time_to_first_token (seconds from admission to the first token, as the TTFT
histogram of core.metrics). A request that fails has status ERROR with the core's reason
(core.errors) as its description's first word and as `error.type`; a cancelled one keeps
status UNSET, finish reason "cancelled", when its caller went away, and has status ERROR when
the core gave it up (SLOW_READER).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from core.errors import CoreError
from core.types import GenerationRequest, RequestState
from oteltrace import Tracing, parent_context

if TYPE_CHECKING:
    from core.pipeline import Job

__all__ = ["CoreTracing", "RequestTrace"]

#: Spans' instrumentation scope.
SCOPE = "trellis.core"


class CoreTracing:
    """The core's tracer, for the service (one per process, made by core.server).

    Args:
        tracing: oteltrace's tracer and provider.
        served_model: the served model's name (gen_ai.request.model of requests naming none).
    """

    __slots__ = ("served_model", "tracer", "tracing")

    def __init__(self, tracing: Tracing, served_model: str):
        self.tracing = tracing
        self.tracer = tracing.tracer
        self.served_model = served_model

    def begin(self, traceparent: str) -> RequestTrace | None:
        """A request was received now; `traceparent` is its caller's span ("" or one that does
        not parse: a trace of its own). None when the caller did not sample its trace: the
        sampler (ParentBased) would record nothing of it, so nothing is made."""
        parent = parent_context(traceparent)
        if parent is not None and not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
            return None
        return RequestTrace(self, parent, time.monotonic())


def traceparent_metadata(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The `traceparent` of a call's gRPC metadata ("" without one)."""
    for key, value in metadata or ():
        if key == "traceparent" and isinstance(value, str):
            return value
    return ""


class RequestTrace:
    """One request's spans, made when it ends: by its Job (`ended`) once it was admitted, or by
    the service (`refused`) when it failed before.

    Attributes:
        received: when the request arrived (time.monotonic() seconds).
    """

    __slots__ = ("_owner", "_parent", "received")

    def __init__(self, owner: CoreTracing, parent: Context | None, received: float):
        self._owner = owner
        self._parent = parent
        self.received = received

    def _root(self, req: GenerationRequest | None, offset: int) -> trace.Span:
        op = "chat" if req is not None and req.messages is not None else "text_completion"
        model = (req.model if req is not None else None) or self._owner.served_model
        attributes: dict[str, AttributeValue] = {"gen_ai.operation.name": op, "gen_ai.request.model": model}
        if req is not None:
            attributes["gen_ai.response.id"] = req.request_id
            s, stop = req.sampling, req.stopping
            if stop.max_new_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = stop.max_new_tokens
            if s.temperature is not None:
                attributes["gen_ai.request.temperature"] = _float32(s.temperature)
            if s.top_p is not None:
                attributes["gen_ai.request.top_p"] = _float32(s.top_p)
        return self._owner.tracer.start_span(
            f"{op} {model}",
            context=self._parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=_ns(self.received, offset),
        )

    def refused(self, error: CoreError, req: GenerationRequest | None) -> None:
        """The request failed before it was admitted (validation, tokenization, a full queue):
        its span, from receipt to now, with status ERROR.

        Args:
            error: why.
            req: the request as converted, when it was.
        """
        now = time.monotonic()
        offset = time.time_ns() - time.monotonic_ns()
        root = self._root(req, offset)
        _fail(root, error)
        root.end(_ns(now, offset))

    def ended(self, job: Job, reason: str, error: CoreError | None) -> None:
        """The admitted request `job` ended now: its span and the stages' (module docstring).

        Args:
            job: the request's Job.
            reason: how it ended (a FinishReason value, "cancelled" or "error").
            error: why it failed, for reason "error".
        """
        end = time.monotonic()
        offset = time.time_ns() - time.monotonic_ns()
        prep = job.prep
        root = self._root(prep.request, offset)
        if not root.is_recording():  # not sampled: nothing to fill in
            root.end()
            return
        tracer = self._owner.tracer
        parent = trace.set_span_in_context(root)
        engine = prep.engine_request
        arrival = engine.arrival_time
        times = job.times
        scheduled = times.get(RequestState.SCHEDULED)
        prefilled = times.get(RequestState.PREFILLED, scheduled)
        first = times.get(RequestState.GENERATING)

        def stage(name: str, start: float, stop: float) -> trace.Span:
            span = tracer.start_span(name, context=parent, start_time=_ns(start, offset))
            span.end(_ns(max(start, stop), offset))
            return span

        stage("tokenize", self.received, arrival)
        stage("queue", arrival, end if scheduled is None else scheduled)
        if scheduled is not None and prefilled is not None:
            stage("prefill", scheduled, prefilled)
            decode = tracer.start_span("decode", context=parent, start_time=_ns(prefilled, offset))
            if first is not None:
                decode.add_event("gen_ai.first_token", timestamp=_ns(first, offset))
            decode.add_event("gen_ai.finish", {"gen_ai.response.finish_reason": reason}, timestamp=_ns(end, offset))
            decode.end(_ns(max(prefilled, end), offset))
        returned = job.returned
        attributes: dict[str, AttributeValue] = {
            "gen_ai.usage.input_tokens": len(engine.prompt_ids),
            "gen_ai.usage.output_tokens": sum(s.generated for s in returned),
            "gen_ai.response.finish_reasons": [
                (s.finished.value if s.finished is not None else reason).lower() for s in returned
            ],
        }
        if first is not None:
            attributes["gen_ai.server.time_to_first_token"] = first - arrival
        root.set_attributes(attributes)
        if error is not None:
            _fail(root, error)
        root.end(_ns(end, offset))


def _ns(monotonic: float, offset: int) -> int:
    """A time.monotonic() instant as nanoseconds since the epoch (`offset`: time.time_ns() less
    time.monotonic_ns(), read once per request)."""
    return int(monotonic * 1e9) + offset


def _float32(value: float) -> float:
    """A proto `float` (float32) field's value as the client wrote it: 0.7, not 0.699999988
    (7 significant digits, float32's precision)."""
    return float(f"{value:.7g}")


def _fail(span: trace.Span, error: CoreError) -> None:
    span.set_status(Status(StatusCode.ERROR, f"{error.reason}: {error.message}"))
    span.set_attribute("error.type", error.reason)
