"""A real OTLP/HTTP trace receiver for tests (and the tracing benchmark): an aiohttp server on
127.0.0.1:0 that accepts `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`
(opentelemetry-proto; gzip or plain), answers an empty `ExportTraceServiceResponse`, and keeps
every span it received as a `ReceivedSpan`."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


@dataclass
class ReceivedSpan:
    """One span as exported (ids in lower-case hex, times in epoch nanoseconds)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    error: bool
    status_message: str
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)

    @property
    def server(self) -> bool:
        return self.kind == Span.SPAN_KIND_SERVER


class Receiver:
    """The receiver; `url` is its traces endpoint once started."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self.url = ""
        self._arrived = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> Receiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        msg = ExportTraceServiceRequest.FromString(raw)
        self.posts += 1
        for rs in msg.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == Status.STATUS_CODE_ERROR,
                            status_message=s.status.message,
                            events=[
                                (e.name, e.time_unix_nano, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                        )
                    )
        self._arrived.set()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def wait_for(self, count: int) -> list[ReceivedSpan]:
        """The spans received, once there are at least `count` (the exporters batch every
        OTEL_BSP_SCHEDULE_DELAY milliseconds), or after 15 s, whatever came by then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(15):
                while len(self.spans) < count:
                    self._arrived.clear()
                    await self._arrived.wait()
        return list(self.spans)
