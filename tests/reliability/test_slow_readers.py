"""A gRPC client that never reads its stream must not grow the core: each stream holds at most
--max-queued-messages-per-stream messages, and a write that waits longer than
--slow-reader-timeout cancels the stream's requests, with RESOURCE_EXHAUSTED, reason
SLOW_READER (core.multiplex.StreamBounds). Real grpc.aio clients on loopback against mock-engine
cores; the client's HTTP/2 window is kept at its initial 64 KiB (no BDP probing), so it fills
after a few dozen messages."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.server import CoreServer
from gateways.common.status import GatewayError
from tests.integration.core_helpers import wait_for

pytestmark = pytest.mark.timeout(120)

BOUND = 64
#: A client that reads nothing: its HTTP/2 window stays at 64 KiB.
NO_PROBING = [("grpc.http2.bdp_probe", 0)]
#: Tokens asked for: far more than the window and the bound hold together.
TOKENS = 3000


def _request(text: str = "hello there") -> spb.GenerateRequest:
    # Token records with 20 alternatives make each message about 2 KB.
    return spb.GenerateRequest(
        text=text,
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=TOKENS),
        output=pb.OutputOptions(tokens=True, logprobs=True, top_logprobs=20),
    )


def _ended(core: CoreServer) -> int:
    """Requests the core has ended so far (finished, failed or cancelled)."""
    return sum(core.servicer.pipeline.metrics.requests.values())


async def _settled(core: CoreServer, ended: int) -> None:
    """Wait until the core has ended `ended` requests."""
    await wait_for(lambda: _ended(core) >= ended)


@pytest.fixture(scope="module")
async def bounded_core(start_mock_core):
    return await start_mock_core(
        mock_step_ms=0.0, mock_context_length=8192, max_queued_messages_per_stream=BOUND, slow_reader_timeout=0
    )


@pytest.fixture(scope="module")
async def timed_core(start_mock_core):
    return await start_mock_core(mock_step_ms=1.0, mock_context_length=8192, slow_reader_timeout=0.2)


async def test_a_generate_call_that_is_not_read_is_cancelled_at_the_bound(bounded_core):
    metrics = bounded_core.servicer.pipeline.metrics
    before, ended = metrics.slow_reader_cancels, _ended(bounded_core)
    async with grpc.aio.insecure_channel(bounded_core.address, options=NO_PROBING) as channel:
        call = spb_grpc.GenerateServiceStub(channel).Generate(_request())
        await _settled(bounded_core, ended + 1)
        assert metrics.slow_reader_cancels == before + 1
        got = [m async for m in _read_until_error(call)]
        code, details = await call.code(), await call.details()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queued-messages-per-stream" in details
    generated = sum(len(o.tokens) for m in got for o in m.outputs)
    assert 0 < generated < TOKENS


async def test_a_multiplex_stream_that_is_not_read_holds_at_most_the_bound(bounded_core):
    """Every open request of the stream is cancelled with its own SLOW_READER status, the
    stream's queue never holds more than the bound, and a start while it is over the bound is
    refused the same way."""
    metrics = bounded_core.servicer.pipeline.metrics
    before, ended = metrics.slow_reader_cancels, _ended(bounded_core)
    async with grpc.aio.insecure_channel(bounded_core.address, options=NO_PROBING) as channel:
        call = spb_grpc.GenerateServiceStub(channel).MultiplexGenerate()
        await call.write(
            spb.MultiplexGenerateRequest(
                starts=[spb.MultiplexStart(id=i, request=_request(f"prompt {i}"), steps=True) for i in range(3)]
            )
        )
        await _settled(bounded_core, ended + 3)
        (session,) = bounded_core.servicer._sessions
        assert session.queued <= BOUND + 3  # and the engine step that crossed it
        assert metrics.slow_reader_cancels == before + 3
        await call.write(spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=9, request=_request())]))
        await call.done_writing()
        statuses = {}
        async for msg in call:
            for event in msg.events:
                if event.HasField("status"):
                    statuses[event.id] = event.status
    assert sorted(statuses) == [0, 1, 2, 9]
    for status in statuses.values():
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "read too slowly" in status.message


async def test_a_write_waiting_past_the_timeout_cancels_the_request(timed_core):
    metrics = timed_core.servicer.pipeline.metrics
    before, ended = metrics.slow_reader_cancels, _ended(timed_core)
    async with grpc.aio.insecure_channel(timed_core.address, options=NO_PROBING) as channel:
        call = spb_grpc.GenerateServiceStub(channel).Generate(_request())
        await _settled(timed_core, ended + 1)
        assert metrics.slow_reader_cancels == before + 1
        _ = [m async for m in _read_until_error(call)]
        code, details = await call.code(), await call.details()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--slow-reader-timeout" in details


async def _read_until_error(call):
    try:
        async for msg in call:
            yield msg
    except grpc.aio.AioRpcError:
        return


async def test_a_duplicate_multiplex_id_is_refused_without_touching_the_open_request(mock_core):
    """The refusal is an event of its own (no responses in it), reason DUPLICATE_ID; the open
    request streams to its final message and one OK, as if the duplicate never came."""
    first = spb.GenerateRequest(
        request_id="open",
        text="hello",
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=40),
    )
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        call = spb_grpc.GenerateServiceStub(channel).MultiplexGenerate()
        await call.write(spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=7, request=first)]))
        await call.read()  # its QUEUED: the request is open
        await call.write(
            spb.MultiplexGenerateRequest(
                starts=[spb.MultiplexStart(id=7, request=spb.GenerateRequest(request_id="dup", text="other"))]
            )
        )
        await call.done_writing()
        events = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            events += msg.events
    refusals = [e for e in events if e.status.code]
    assert len(refusals) == 1
    (refusal,) = refusals
    assert not refusal.responses
    err = GatewayError.from_status(refusal.status.code, refusal.status.message, refusal.status.details)
    assert (err.reason, err.param) == ("DUPLICATE_ID", "id")
    responses = [r for e in events for r in e.responses]
    assert {r.request_id for r in responses} == {"open"}
    assert responses[-1].usage.completion_tokens == 40
    oks = [e for e in events if e.HasField("status") and not e.status.code]
    assert len(oks) == 1
    assert events.index(oks[0]) == len(events) - 1
