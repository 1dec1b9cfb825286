"""The HF engine process watched (core.engine.hf_process): a real core on the tiny model whose
engine process is stopped (SIGSTOP) and killed (SIGKILL).

Stopped with requests pending, the core itself stays responsive (its event loop never blocks on
the full pipe to the engine), health turns NOT_SERVING after --engine-stall-seconds and SERVING
again once the process continues, and the pending requests then finish. Killed, the request in
flight ends with its in-band error (INTERNAL), one not scheduled yet with UNAVAILABLE, the
process is restarted (new requests meanwhile get UNAVAILABLE, which gateways answer 503 with
Retry-After), and a new request succeeds; the
restart counter and the stall gauge are on the core's metrics.
"""

from __future__ import annotations

import os
import signal

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.engine.hf_process import HfProcessEngine
from core.server import CoreServer, start_core
from tests.conftest import core_config
from tests.integration.core_helpers import request, wait_for, wait_health

pytestmark = pytest.mark.timeout(180)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def engine_of(server: CoreServer) -> HfProcessEngine:
    assert isinstance(server.engine, HfProcessEngine)
    return server.engine


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        return reply.status


async def rest(call: grpc.aio.UnaryStreamCall) -> list[spb.GenerateResponse]:
    """The messages of a call read with `read()` so far, to its end."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


async def metric(metrics_port: int, name: str) -> float:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp,
    ):
        for line in (await resp.text()).splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


async def test_a_stopped_engine_turns_health_not_serving_and_serving_once_it_continues(tiny_model_dir):
    server = await start_core(
        core_config(tiny_model_dir, engine_stall_seconds=0.5, metrics_port=0, max_batch_size=2, max_queue_size=64)
    )
    engine = engine_of(server)
    assert server.metrics is not None
    pid = engine._process.pid
    channel = grpc.aio.insecure_channel(server.address)
    stub = spb_grpc.GenerateServiceStub(channel)
    try:
        running = stub.Generate(request({"text": "x", "stopping": {"maxNewTokens": 200, "ignoreEos": True}}))
        while (await running.read()).state != pb.GENERATE_STATE_GENERATING:
            pass
        os.kill(pid, signal.SIGSTOP)
        # More than the pipe holds (64 KiB on Linux): long prompts, each pickled as its token ids.
        prompt = " ".join(f"w{i}" for i in range(250))
        pending = [
            stub.Generate(request({"text": prompt, "stopping": {"maxNewTokens": 2}, "requestId": f"p{i}"}))
            for i in range(60)
        ]
        for call in pending:
            assert (await call.read()).state == pb.GENERATE_STATE_QUEUED
        await wait_health(server.address, NOT_SERVING)
        assert await health(server.address) == NOT_SERVING  # the core answers while its engine is stopped
        assert await metric(server.metrics.port, "trellis_core_engine_stall_seconds") > 0.5
        os.kill(pid, signal.SIGCONT)
        await wait_health(server.address, SERVING)
        for call in pending:
            assert (await rest(call))[-1].HasField("usage")
        assert (await rest(running))[-1].HasField("usage")
        assert await metric(server.metrics.port, "trellis_core_engine_stall_seconds") == 0
    finally:
        os.kill(pid, signal.SIGCONT)
        await channel.close()
        await server.stop(0)


async def test_a_killed_engine_fails_its_request_in_band_and_is_restarted(tiny_model_dir, start_gateway):
    server = await start_core(core_config(tiny_model_dir, metrics_port=0, engine_max_restarts=1))
    engine = engine_of(server)
    assert server.metrics is not None
    channel = grpc.aio.insecure_channel(server.address)
    stub = spb_grpc.GenerateServiceStub(channel)
    url = await start_gateway("openai", core=server.address)
    try:
        call = stub.Generate(request({"text": "x", "stopping": {"maxNewTokens": 400, "ignoreEos": True}}))
        while (await call.read()).state != pb.GENERATE_STATE_GENERATING:
            pass
        first = engine._process.pid
        os.kill(first, signal.SIGSTOP)  # so that the next request is admitted but never scheduled
        queued = stub.Generate(request({"text": "x", "stopping": {"maxNewTokens": 2}}))
        assert (await queued.read()).state == pb.GENERATE_STATE_QUEUED
        os.kill(first, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await rest(call)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "exit code -9" in (failed.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as unscheduled:  # it lost nothing: retry
            await rest(queued)
        assert unscheduled.value.code() == grpc.StatusCode.UNAVAILABLE
        # The restart waits for the new process to load its model: until then, no engine.
        await wait_for(lambda: engine._restarting)
        assert await health(server.address) == NOT_SERVING
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 503, await resp.text()
            assert resp.headers["Retry-After"] == "1"
        await wait_health(server.address, SERVING)
        assert engine._process.pid != first
        async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        assert await metric(server.metrics.port, "trellis_core_engine_restarts_total") == 1
        # Out of restarts (--engine-max-restarts 1): the next death is final.
        os.kill(engine._process.pid, signal.SIGKILL)
        await wait_health(server.address, NOT_SERVING)
        await wait_for(lambda: not engine.alive)
        assert not engine._restarting
    finally:
        await channel.close()
        await server.stop(0)


async def test_an_engine_that_cannot_be_restarted_is_dead(tiny_model_dir, tmp_path):
    server = await start_core(core_config(tiny_model_dir, engine_max_restarts=2))
    engine = engine_of(server)
    deaths: list[Exception] = []
    engine.set_on_dead(deaths.append)
    # The model's weights go away: the new process cannot load them.
    engine._path = str(tmp_path / "gone")
    try:
        os.kill(engine._process.pid, signal.SIGKILL)
        await wait_for(lambda: bool(deaths))
        assert "could not be restarted" in str(deaths[0])
        assert await health(server.address) == NOT_SERVING
        assert not engine.alive
    finally:
        await server.stop(0)


@pytest.mark.parametrize("flag", ["--engine-stall-seconds=-1", "--engine-max-restarts=-1"])
def test_a_negative_watchdog_flag_is_a_usage_error(flag, capsys):
    from core.config import load

    with pytest.raises(SystemExit):
        load(["--model", "m", flag], {})
    assert flag.split("=")[0] in capsys.readouterr().err
