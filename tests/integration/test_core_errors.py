"""The core's error paths that only a broken or slow engine reaches, over real gRPC on loopback.

The engine is tests/fakes/scripted_engine.py (a real engine cannot be made to fail on cue);
the pipeline, service, session store and server are the real ones.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.pipeline import OFF_LOOP_CHARS
from core.server import start_core
from core.types import EngineOutput, SequenceStep
from tests.conftest import core_config
from tests.fakes.scripted_engine import Script, ScriptedEngine, tokens_then_length
from tests.integration.core_helpers import bad_request_field, generate, request, sequences


@contextlib.asynccontextmanager
async def scripted_core(tiny_model_dir, tokenizer, script: Script) -> AsyncIterator[tuple]:
    """A core on 127.0.0.1:0 whose engine plays `script`; yields (stub, engine)."""
    engine = ScriptedEngine(tokenizer.vocab_size, script)
    server = await start_core(core_config(tiny_model_dir), engine=engine, tokenizer=tokenizer)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield spb_grpc.GenerateServiceStub(channel), engine
    finally:
        await server.stop(0)


async def read_all(call) -> tuple[list, grpc.aio.AioRpcError]:
    """The messages a call delivered before it failed, and its error."""
    msgs = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while (m := await call.read()) is not grpc.aio.EOF:
            msgs.append(m)
    return msgs, e.value


async def test_an_unexpected_exception_is_internal_and_logged(tiny_model_dir, tokenizer, caplog):
    def broken(req):
        raise RuntimeError("a bug in the engine")

    async with scripted_core(tiny_model_dir, tokenizer, broken) as (stub, _engine):
        msgs, error = await read_all(stub.Generate(request({"text": "x", "requestId": "bug-1"})))
    assert msgs == [] and error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "Internal error while serving request bug-1; see the server log."
    assert "request bug-1 failed" in caplog.text and "a bug in the engine" in caplog.text


async def test_an_unexpected_exception_at_a_multiplexed_start_is_internal_and_logged(tiny_model_dir, tokenizer, caplog):
    """On MultiplexGenerate, the request's terminal status: the same for a prompt tokenized on
    the event loop and for a long one tokenized off it."""

    def broken(req):
        raise RuntimeError("a bug in the engine")

    starts = [
        spb.MultiplexStart(id=1, request=request({"text": "x", "requestId": "bug-1"})),
        spb.MultiplexStart(
            id=2,
            request=request(
                {"text": "x" * (OFF_LOOP_CHARS + 1), "requestId": "bug-2", "stopping": {"truncateInputTokens": 8}}
            ),
        ),
    ]
    async with scripted_core(tiny_model_dir, tokenizer, broken) as (stub, _engine):
        call = stub.MultiplexGenerate()
        await call.write(spb.MultiplexGenerateRequest(starts=starts))
        statuses = {}
        while len(statuses) < 2:
            msg = await call.read()
            assert msg is not grpc.aio.EOF
            statuses.update({e.id: e.status for e in msg.events if e.HasField("status")})
        call.cancel()
    for rid, request_id in ((1, "bug-1"), (2, "bug-2")):
        assert statuses[rid].code == grpc.StatusCode.INTERNAL.value[0]
        assert statuses[rid].message == f"Internal error while serving request {request_id}; see the server log."
        assert f"request {request_id} failed" in caplog.text
    assert "a bug in the engine" in caplog.text


async def test_a_stalled_engine_is_ended_by_the_time_limit_and_aborted(tiny_model_dir, tokenizer):
    def stalls(req):  # one token, then nothing ever again
        return [EngineOutput(req.request_id, sequences=[SequenceStep(0, [300])])]

    async with scripted_core(tiny_model_dir, tokenizer, stalls) as (stub, engine):
        msgs = await generate(stub, {"text": "x", "stopping": {"timeLimitMs": 100}})
    seq = sequences(msgs)[0]
    assert seq["ids"] == [300] and seq["finish"] == pb.FINISH_REASON_TIME_LIMIT
    assert msgs[-1].usage.completion_tokens == 1
    assert engine.aborted == [engine.requests[0].request_id]


async def test_an_engine_error_fails_the_call_and_leaves_the_session_as_it_was(tiny_model_dir, tokenizer):
    fail = False

    def script(req):
        if fail:
            step = SequenceStep(0, [301])
            return [EngineOutput(req.request_id, sequences=[step]), EngineOutput(req.request_id, error=OSError("lost"))]
        return tokens_then_length([300, 301])(req)

    async with scripted_core(tiny_model_dir, tokenizer, script) as (stub, engine):
        await generate(stub, {"text": "x", "sessionId": "s"})
        session = [*engine.requests[0].prompt_ids, 300, 301]
        fail = True
        msgs, error = await read_all(stub.Generate(request({"sessionId": "s"})))
        assert msgs[0].session_continued and error.code() == grpc.StatusCode.INTERNAL and "lost" in error.details()
        fail = False
        msgs = await generate(stub, {"sessionId": "s"})
        assert msgs[0].session_continued and engine.requests[-1].prompt_ids == session


async def test_a_session_in_use_is_refused_until_its_request_ends(tiny_model_dir, tokenizer):
    async with scripted_core(tiny_model_dir, tokenizer, tokens_then_length([300])) as (stub, engine):
        engine.gate.clear()  # requests wait after QUEUED
        holder = stub.Generate(request({"text": "x", "sessionId": "held"}))
        assert (await holder.read()).state == pb.GENERATE_STATE_QUEUED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, {"text": "y", "sessionId": "held"})
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and bad_request_field(e.value) == "session_id"
        engine.gate.set()
        while await holder.read() is not grpc.aio.EOF:
            pass
        msgs = await generate(stub, {"text": "y", "sessionId": "held"})
        assert msgs[0].session_continued and sequences(msgs)[0]["ids"] == [300]


async def test_an_address_in_use_fails_start_and_stops_the_engine(tiny_model_dir, tokenizer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        engine = ScriptedEngine(tokenizer.vocab_size, tokens_then_length([300]))
        config = core_config(tiny_model_dir, port=taken.getsockname()[1])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{config.port}"):
            await start_core(config, engine=engine, tokenizer=tokenizer)
    assert not engine.alive and engine._stopping


async def test_a_port_another_core_holds_fails_start(tiny_model_dir, tokenizer):
    """grpc's default SO_REUSEPORT would let the second core bind and share the first's
    connections (grpc/grpc#10755); the core turns it off, so the second start fails."""
    first = ScriptedEngine(tokenizer.vocab_size, tokens_then_length([300]))
    server = await start_core(core_config(tiny_model_dir), engine=first, tokenizer=tokenizer)
    try:
        second = ScriptedEngine(tokenizer.vocab_size, tokens_then_length([300]))
        config = core_config(tiny_model_dir, port=server.port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
            await start_core(config, engine=second, tokenizer=tokenizer)
        assert not second.alive
    finally:
        await server.stop(0)
