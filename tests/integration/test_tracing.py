"""OpenTelemetry traces from gateway to core (docs/observability.md, "Tracing"), exported to a
real OTLP/HTTP receiver (tests/integration/otlp_receiver.py) by in-process mock-engine cores and
gateways, over MultiplexGenerate (the default) and over one Generate call per request (what a
gateway falls back to when its core answers MultiplexGenerate with UNIMPLEMENTED).

For every gateway and OpenAI route: one request is one connected trace (one trace id, one root,
every parent present); the gateway's span covers the core's request span, whose stages (tokenize,
queue, prefill, decode) cover at least 95 % of it; a client's `traceparent` is continued; a
sample ratio of 0 exports nothing; a request the core refuses has status ERROR with its reason.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from core.server import CoreServer
from core.service import GenerateServicer
from tests.integration.core_helpers import generate, request
from tests.integration.gateway_helpers import ws_url
from tests.integration.otlp_receiver import ReceivedSpan, Receiver

#: (gateway, route, body); `bad` bodies carry a top_p the core refuses (INVALID_ARGUMENT).
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "lmi": (
        "lmi",
        "/invocations",
        {"inputs": "Hello", "parameters": {"max_new_tokens": 8, "details": True}},
        {"inputs": "Hello", "parameters": {"max_new_tokens": 8, "top_p": 5}},
    ),
    "openai-chat": (
        "openai",
        "/v1/chat/completions",
        {
            "model": "mock",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8,
            "stream": True,
            "top_p": 0.9,
        },
        {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "top_p": 5},
    ),
    "openai-completions": (
        "openai",
        "/v1/completions",
        {"model": "mock", "prompt": "Hello", "max_tokens": 8, "stream": True, "temperature": 0.7},
        {"model": "mock", "prompt": "Hello", "max_tokens": 8, "top_p": 5},
    ),
    "openai-responses": (
        "openai",
        "/v1/responses",
        {"model": "mock", "input": "Hello", "max_output_tokens": 8, "stream": True},
        {"model": "mock", "input": "Hello", "max_output_tokens": 8, "top_p": 5},
    ),
    "openai-messages": (
        "openai",
        "/v1/messages",
        {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True},
        {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "top_p": 5},
    ),
    "triton": (
        "triton",
        "/v2/models/mock/generate_stream",
        {"text_input": "Hello", "max_tokens": 8},
        {"text_input": "Hello", "max_tokens": 8, "top_p": 5},
    ),
    "ws": (
        "ws",
        "/ws",
        {"prompts": [{"request_id": "p1", "prompt": "Hello"}], "generation_config": {"max_new_tokens": 8}},
        {"prompts": [{"request_id": "p1", "prompt": "Hello"}], "generation_config": {"top_p": 5}},
    ),
}
GATEWAYS = ("lmi", "openai", "triton", "ws")
#: The spans of one successful request: the gateway's, the core's and its four stages.
STAGES = {"tokenize", "queue", "prefill", "decode"}


@pytest.fixture(scope="module", autouse=True)
def _fast_export() -> Any:
    """Exporters send their batch every 20 ms instead of 5 s (the SDK reads the variable when a
    BatchSpanProcessor is made)."""
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "20"
    yield
    if old is None:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
    else:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old


@pytest_asyncio.fixture(scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    r = await Receiver().start()
    yield r
    await r.stop()


@pytest_asyncio.fixture(scope="module")
async def unsampled_receiver() -> AsyncIterator[Receiver]:
    r = await Receiver().start()
    yield r
    await r.stop()


async def _no_multiplex(self: Any, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")


@pytest_asyncio.fixture(scope="module")
async def traced_core(start_mock_core, receiver) -> CoreServer:
    return await start_mock_core(otlp_traces_endpoint=receiver.url)


@pytest_asyncio.fixture(scope="module")
async def stacks(
    start_mock_core, start_gateway, traced_core, receiver, unsampled_receiver
) -> dict[str, dict[str, str]]:
    """Gateways by path: "multiplex" (a traced core), "generate" (a traced core without
    MultiplexGenerate, so each request is a Generate call) and "unsampled" (gateways at ratio
    0 in front of a core at ratio 1, all exporting to `unsampled_receiver`)."""
    url, core = receiver.url, traced_core
    original = GenerateServicer.MultiplexGenerate
    GenerateServicer.MultiplexGenerate = _no_multiplex  # type: ignore[method-assign,assignment]
    try:
        old_core = await start_mock_core(otlp_traces_endpoint=url)
    finally:
        GenerateServicer.MultiplexGenerate = original  # type: ignore[method-assign]
    quiet = await start_mock_core(otlp_traces_endpoint=unsampled_receiver.url, otlp_traces_sample_ratio=1.0)
    out: dict[str, dict[str, str]] = {"multiplex": {}, "generate": {}, "unsampled": {}}
    for name in GATEWAYS:
        out["multiplex"][name] = await start_gateway(name, core=core.address, otlp_traces_endpoint=url)
        out["generate"][name] = await start_gateway(name, core=old_core.address, otlp_traces_endpoint=url)
        out["unsampled"][name] = await start_gateway(
            name, core=quiet.address, otlp_traces_endpoint=unsampled_receiver.url, otlp_traces_sample_ratio=0.0
        )
    return out


async def send(case: str, base: str, *, bad: bool = False, traceparent: str | None = None) -> int:
    """Send a case's request and read its whole answer; its HTTP status (a WebSocket prompt:
    200 after COMPLETE, 400 after ERROR)."""
    gateway, route, good, refused = CASES[case]
    body = refused if bad else good
    headers = {"traceparent": traceparent} if traceparent else {}
    if gateway == "ws":
        async with connect(ws_url(base), additional_headers=headers) as sock:
            await sock.send(json.dumps(body))
            while True:
                for event in json.loads(await sock.recv()):
                    if event.get("type") in ("COMPLETE", "ERROR"):
                        return 200 if event["type"] == "COMPLETE" else 400
    async with aiohttp.ClientSession() as http, http.post(base + route, json=body, headers=headers) as r:
        await r.read()
        return r.status


def check_connected(spans: list[ReceivedSpan], parent: str = "") -> ReceivedSpan:
    """One trace: one trace id, every parent present, one root (whose parent is `parent`, the
    client's span, or none); returns the root."""
    assert len({s.trace_id for s in spans}) == 1, spans
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    assert len(roots) == 1, [(s.name, s.parent_id) for s in spans]
    assert roots[0].parent_id == parent
    return roots[0]


def covered(children: list[ReceivedSpan], start: int, end: int) -> float:
    """The share of [start, end] the union of `children`'s intervals covers."""
    total, cursor = 0, start
    for s in sorted(children, key=lambda s: s.start):
        lo, hi = max(s.start, cursor), min(s.end, end)
        if hi > lo:
            total += hi - lo
            cursor = hi
    return total / max(1, end - start)


def core_span(spans: list[ReceivedSpan]) -> ReceivedSpan:
    [core] = [s for s in spans if s.service == "trellis-core" and s.server]
    return core


@pytest.mark.parametrize("path", ["multiplex", "generate"])
@pytest.mark.parametrize("case", list(CASES))
async def test_one_request_is_one_connected_trace(stacks, receiver, case, path):
    receiver.spans.clear()
    assert await send(case, stacks[path][CASES[case][0]]) == 200
    spans = await receiver.wait_for(2 + len(STAGES))
    assert len(spans) == 2 + len(STAGES), [s.name for s in spans]
    root = check_connected(spans)
    gateway, route = CASES[case][:2]
    assert root.service == f"trellis-gateway-{gateway}" and root.server
    template = route.replace("/mock/", "/{model}/")  # http.route is the route's template
    assert root.attributes["http.route"] == template
    assert root.attributes["gen_ai.request.model"] == "mock"
    if gateway == "ws":
        assert root.name == "/ws prompt"
    else:
        assert root.name == f"POST {template}"
        assert root.attributes["http.response.status_code"] == 200
    core = core_span(spans)
    assert core.parent_id == root.span_id
    assert root.start <= core.start and core.end <= root.end
    stages = [s for s in spans if s.parent_id == core.span_id]
    assert {s.name for s in stages} == STAGES
    assert covered(stages, core.start, core.end) >= 0.95
    a = core.attributes
    assert a["gen_ai.request.model"] == "mock"
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 8
    assert 0 < a["gen_ai.server.time_to_first_token"] <= (core.end - core.start) / 1e9
    chat = case in ("openai-chat", "openai-messages", "openai-responses")
    assert a["gen_ai.operation.name"] == ("chat" if chat else "text_completion")
    if case == "openai-completions":
        assert a["gen_ai.request.temperature"] == 0.7 and "gen_ai.request.top_p" not in a
    if case == "openai-chat":
        assert a["gen_ai.request.top_p"] == 0.9
    [decode] = [s for s in stages if s.name == "decode"]
    events = {name: attrs for name, _, attrs in decode.events}
    assert set(events) == {"gen_ai.first_token", "gen_ai.finish"}
    assert events["gen_ai.finish"]["gen_ai.response.finish_reason"] == "length"
    assert not any(s.error for s in spans)


@pytest.mark.parametrize("path", ["multiplex", "generate"])
@pytest.mark.parametrize("case", list(CASES))
async def test_a_client_traceparent_is_continued(stacks, receiver, case, path):
    receiver.spans.clear()
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    assert await send(case, stacks[path][CASES[case][0]], traceparent=f"00-{trace_id}-{span_id}-01") == 200
    spans = await receiver.wait_for(2 + len(STAGES))
    root = check_connected(spans, parent=span_id)
    assert root.trace_id == trace_id


async def test_a_traceparent_that_does_not_parse_starts_a_trace(stacks, receiver):
    receiver.spans.clear()
    assert await send("openai-chat", stacks["multiplex"]["openai"], traceparent="00-nonsense-01") == 200
    check_connected(await receiver.wait_for(2 + len(STAGES)))


@pytest.mark.parametrize("case", ["lmi", "openai-chat", "triton", "ws"])
async def test_sample_ratio_zero_exports_nothing(stacks, unsampled_receiver, receiver, case):
    """The gateway samples nothing, and its core (ratio 1) follows the gateway's decision; the
    same request on a gateway at ratio 1 is exported (the positive control)."""
    assert await send(case, stacks["unsampled"][CASES[case][0]]) == 200
    receiver.spans.clear()
    assert await send(case, stacks["multiplex"][CASES[case][0]]) == 200
    await receiver.wait_for(2 + len(STAGES))  # by then the unsampled request's spans would be out too
    assert unsampled_receiver.spans == [] and unsampled_receiver.posts == 0


@pytest.mark.parametrize("path", ["multiplex", "generate"])
@pytest.mark.parametrize("case", ["lmi", "openai-chat", "triton", "ws"])
async def test_a_refused_request_has_status_error(stacks, receiver, case, path):
    receiver.spans.clear()
    status = await send(case, stacks[path][CASES[case][0]], bad=True)
    assert status in (400, 424)
    spans = await receiver.wait_for(2)
    assert len(spans) == 2, [s.name for s in spans]
    root = check_connected(spans)
    core = core_span(spans)
    assert core.parent_id == root.span_id
    for span in (root, core):
        assert span.error and span.status_message.startswith("INVALID_ARGUMENT: ")
        assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    if CASES[case][0] != "ws":
        assert root.attributes["http.response.status_code"] == status


async def test_a_prompt_its_socket_gives_up_ends_its_spans_without_error(stacks, receiver):
    """A WebSocket closed while its prompt decodes: the prompt's span ends with the socket, and
    the core's, whose request is cancelled, says so in its finish reason, not as an error."""
    receiver.spans.clear()
    body = {"prompts": [{"request_id": "long", "prompt": "Hello"}], "generation_config": {"max_new_tokens": 500}}
    async with connect(ws_url(stacks["multiplex"]["ws"])) as sock:
        await sock.send(json.dumps(body))
        while not any(e.get("type") == "PROGRESS" for e in json.loads(await sock.recv())):
            pass
    spans = await receiver.wait_for(2 + len(STAGES))
    root = check_connected(spans)
    core = core_span(spans)
    assert root.name == "/ws prompt" and core.parent_id == root.span_id
    assert not root.error and not core.error
    assert core.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert 0 < core.attributes["gen_ai.usage.output_tokens"] < 500


@pytest.mark.parametrize("how", ["metadata", "field"])
async def test_a_grpc_client_of_the_core_passes_its_traceparent_either_way(traced_core, receiver, how):
    """Generate continues the `traceparent` of the call's metadata or of the request's
    `trace_context` field (the one MultiplexGenerate starts use)."""
    receiver.spans.clear()
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{trace_id}-{span_id}-01"
    body = {"text": "Hello", "stopping": {"max_new_tokens": 4}}
    async with grpc.aio.insecure_channel(traced_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        if how == "field":
            msgs = await generate(stub, {**body, "trace_context": traceparent})
        else:
            msgs = [m async for m in stub.Generate(request(body), metadata=(("traceparent", traceparent),))]
    assert msgs[-1].HasField("usage")
    spans = await receiver.wait_for(1 + len(STAGES))
    root = check_connected(spans, parent=span_id)
    assert root.trace_id == trace_id and root.service == "trellis-core"
    assert {s.name for s in spans if s is not root} == STAGES


async def test_a_request_cancelled_for_a_slow_reader_has_status_error(start_mock_core, receiver):
    """A Generate call whose client reads nothing is cancelled at the stream's bound
    (SLOW_READER): its span says so, with status ERROR, though the core counts it cancelled."""
    core = await start_mock_core(
        mock_step_ms=0.0,
        mock_context_length=8192,
        max_queued_messages_per_stream=64,
        slow_reader_timeout=0,
        otlp_traces_endpoint=receiver.url,
    )
    receiver.spans.clear()
    body = {
        "text": "Hello",
        "stopping": {"max_new_tokens": 3000},
        "output": {"tokens": True, "logprobs": True, "top_logprobs": 20},
    }
    # A client that reads nothing: its HTTP/2 window stays at 64 KiB.
    async with grpc.aio.insecure_channel(core.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = spb_grpc.GenerateServiceStub(channel).Generate(request(body))
        spans = await receiver.wait_for(1 + len(STAGES))
        call.cancel()
    root = check_connected(spans)
    assert root.error and root.attributes["error.type"] == "SLOW_READER"
    assert root.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]
