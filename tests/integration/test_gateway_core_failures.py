"""Core failures the real core cannot be made to produce on demand, through every gateway.

A stand-in core (a real gRPC server on loopback running a scripted GenerateService; the prompt
text picks the script) answers:
- "no-final": a token, then the call ends with OK but without its final message (no usage);
- "cancelled": a token, then the final message with the sequence CANCELLED (what the core sends
  when it aborts a request it still answers);
- "fail-mid-stream": the lifecycle markers, then the call fails with INTERNAL.

Each gateway must render these in its own schema (docs/architecture.md, "Errors"): before the
first byte as an error status, after it in-band. The incomplete-stream rule itself lives once,
in gateways.common.core_call.CoreCall.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from tests.conftest import NO_REUSEPORT
from tests.integration.gateway_helpers import CANCELLED, INCOMPLETE, lmi_error, lmi_stream_error, openai_error, records

MODEL = "scripted"
TOKEN = pb.Token(id=5, text="Hel", logprob=-0.5)


class _ScriptedCore(spb_grpc.GenerateServiceServicer):
    async def Generate(self, request, context):
        rid = request.request_id
        script = request.text or request.messages.messages[-1].content[0].text
        yield spb.GenerateResponse(request_id=rid, state=pb.GENERATE_STATE_QUEUED)
        yield spb.GenerateResponse(request_id=rid, state=pb.GENERATE_STATE_SCHEDULED)
        if script == "fail-mid-stream":
            await context.abort(grpc.StatusCode.INTERNAL, "The engine failed this request.")
        yield spb.GenerateResponse(
            request_id=rid,
            state=pb.GENERATE_STATE_PREFILLED,
            outputs=[pb.SequenceOutput(index=0, text="Hel", tokens=[TOKEN])],
        )
        if script == "cancelled":
            yield spb.GenerateResponse(
                request_id=rid,
                outputs=[pb.SequenceOutput(index=0, finish_reason=pb.FINISH_REASON_CANCELLED)],
                usage=pb.Usage(prompt_tokens=2, completion_tokens=1),
            )
        # "no-final": the call ends here, with OK, without the final message

    async def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model_name=MODEL, model_version="1", engine="hf")


@pytest_asyncio.fixture(scope="module")
async def scripted_core():
    server = grpc.aio.server(options=NO_REUSEPORT)
    spb_grpc.add_GenerateServiceServicer_to_server(_ScriptedCore(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest_asyncio.fixture(scope="module")
async def urls(start_gateway, scripted_core) -> dict[str, str]:
    """Every gateway in front of the scripted core."""
    return {
        "lmi": await start_gateway("lmi", core=scripted_core),
        "lmi-dynamic": await start_gateway("lmi", core=scripted_core, batching="dynamic"),
        "openai": await start_gateway("openai", core=scripted_core),
        "triton": await start_gateway("triton", core=scripted_core),
        "ws": await start_gateway("ws", core=scripted_core, env_file=""),
    }


async def post(url: str, body: dict) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, r.content_type, await r.text()


# ------------------------------------------------------------------------------ before the first byte


@pytest.mark.parametrize(
    ("gateway", "path", "body", "status", "expected"),
    [
        (
            "lmi",
            "/invocations",
            {"inputs": "no-final"},
            500,
            lmi_error(INCOMPLETE),
        ),
        (
            "lmi",
            "/invocations",
            {"inputs": "cancelled"},
            503,
            lmi_error(CANCELLED),
        ),
        (
            "lmi-dynamic",
            "/invocations",
            {"inputs": ["no-final"]},
            424,
            {"code": 424, "message": "invoke handler failure", "error": INCOMPLETE},
        ),
        (
            "openai",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "no-final"}]},
            500,
            openai_error(INCOMPLETE, "incomplete_stream"),
        ),
        ("triton", f"/v2/models/{MODEL}/generate", {"text_input": "no-final"}, 500, {"error": INCOMPLETE}),
    ],
)
async def test_non_streaming_failures_are_error_statuses(urls, gateway, path, body, status, expected):
    got_status, content_type, text = await post(urls[gateway] + path, body)
    assert (got_status, content_type, json.loads(text)) == (status, "application/json", expected)


@pytest.mark.parametrize(
    ("gateway", "path", "body", "finish_reason"),
    [
        ("openai", "/v1/chat/completions", {"messages": [{"role": "user", "content": "cancelled"}]}, "abort"),
        ("triton", f"/v2/models/{MODEL}/generate", {"text_input": "cancelled"}, "cancelled"),
    ],
)
async def test_schemas_with_a_cancelled_finish_reason_report_it(urls, gateway, path, body, finish_reason):
    status, _, text = await post(urls[gateway] + path, body)
    answer = json.loads(text)
    assert status == 200
    got = answer["choices"][0]["finish_reason"] if gateway == "openai" else answer["finish_reason"]
    assert got == finish_reason


# ------------------------------------------------------------------------------ after the first byte


async def test_lmi_stream_ends_with_the_error_record(urls):
    for script, message in (("no-final", INCOMPLETE), ("cancelled", CANCELLED)):
        status, content_type, text = await post(urls["lmi"] + "/invocations", {"inputs": script, "stream": True})
        assert (status, content_type) == (200, "application/jsonlines")
        got = records(text)
        assert got[0] == {"token": {"id": 5, "text": "Hel", "log_prob": -0.5}}
        assert got[-1] == lmi_stream_error(message)


async def test_lmi_dynamic_stream_ends_with_the_error_record(urls):
    status, _, text = await post(urls["lmi-dynamic"] + "/invocations", {"inputs": ["no-final"], "stream": True})
    assert status == 200
    assert records(text) == [
        {"outputs": ["Hel"]},
        {"code": 424, "message": "invoke handler failure", "error": INCOMPLETE},
    ]


async def test_openai_stream_ends_with_the_error_event_and_done(urls):
    body = {"messages": [{"role": "user", "content": "no-final"}], "stream": True}
    status, content_type, text = await post(urls["openai"] + "/v1/chat/completions", body)
    assert (status, content_type) == (200, "text/event-stream")
    assert text.endswith("data: [DONE]\n\n")
    got = records(text)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert got[-1] == openai_error(INCOMPLETE, "incomplete_stream")


async def test_triton_stream_ends_with_the_error_event(urls):
    body = {"text_input": "no-final"}
    status, _, text = await post(urls["triton"] + f"/v2/models/{MODEL}/generate_stream", body)
    assert status == 200
    got = records(text)
    assert got[0] == {"model_name": MODEL, "model_version": "1", "text_output": "Hel"}
    assert got[-1] == {"error": INCOMPLETE}


async def test_ws_failures_after_admission_follow_the_lifecycle_events(urls):
    ids = ("fail-mid-stream", "no-final", "cancelled")
    events: dict[str, list[dict]] = {rid: [] for rid in ids}
    async with connect("ws" + urls["ws"].removeprefix("http") + "/ws") as ws:
        await ws.send(json.dumps({"prompts": [{"request_id": rid, "prompt": rid} for rid in ids]}))
        while any(not e or e[-1]["type"] not in ("COMPLETE", "ERROR") for e in events.values()):
            for event in json.loads(await asyncio.wait_for(ws.recv(), 60)):  # a guard against hangs
                events[event["request_id"]].append(event)
    assert events["fail-mid-stream"] == [
        {"request_id": "fail-mid-stream", "type": "ACCEPTED"},
        {"request_id": "fail-mid-stream", "type": "STARTED"},
        {"request_id": "fail-mid-stream", "type": "ERROR", "error": "The engine failed this request."},
    ]
    for rid, message in (("no-final", INCOMPLETE), ("cancelled", CANCELLED)):
        assert [e["type"] for e in events[rid]] == ["ACCEPTED", "STARTED", "INITIALIZED", "PROGRESS", "ERROR"]
        assert events[rid][-1] == {"request_id": rid, "type": "ERROR", "error": message}
