"""Graceful drain (SIGTERM) of the core with streams in flight: through every gateway and
straight over gRPC, the streams finish complete, new calls are refused at once (UNAVAILABLE on
gRPC, 503 through the HTTP gateways, an ERROR event on WebSocket), health reports NOT_SERVING,
and the core stops within --drain-seconds (+0.5 s). `make soak` records the times (scenario in
tests/reliability/scenarios.py). A second signal during the drain (servestop) cuts it short
neither in the core's process (uvloop's loop) nor in a gateway's (asyncio's), whose health
reports not serving while it still serves requests, and which then exits."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from tests.integration.core_helpers import start_core_process, start_module
from tests.integration.gateway_helpers import GATEWAYS
from tests.reliability.scenarios import drain

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("engine", ["mock", "hf"])
async def test_sigterm_finishes_streams_in_flight_and_refuses_new_calls(
    engine, tokenizer_only_dir, tiny_model_dir, start_gateway
):
    """On the mock engine, and on the HF engine (tiny model) with its engine process; a SIGINT
    once the drain has begun changes nothing."""
    if engine == "mock":
        args: tuple[str, ...] = ("--model", str(tokenizer_only_dir), "--engine", "mock", "--mock-step-ms", "5")
        drain_s, tokens = 3.0, 200
    else:
        args = ("--model", str(tiny_model_dir), "--max-batch-size", "8")
        drain_s, tokens = 20.0, 40
    proc, addr = await start_core_process(*args, "--model-name", "mock", "--port", "0", "--drain-seconds", str(drain_s))
    try:
        extra: dict[str, dict] = {"ws": {"env_file": ""}}
        urls = {name: await start_gateway(name, core=addr, **extra.get(name, {})) for name in GATEWAYS}
        async with grpc.aio.insecure_channel(addr) as channel:
            # Watched from before the signal: once draining, the server takes no new connection.
            health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await health.read()).status == health_pb2.HealthCheckResponse.SERVING

            statuses = []

            async def exited() -> None:
                # Once the drain has begun (health NOT_SERVING), a second signal changes nothing.
                while not statuses or statuses[-1] != health_pb2.HealthCheckResponse.NOT_SERVING:
                    statuses.append((await health.read()).status)
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == 0

            figures = await drain(urls, addr, lambda: proc.send_signal(signal.SIGTERM), exited, drain_s, tokens)
            with pytest.raises(grpc.aio.AioRpcError):
                while True:
                    statuses.append((await health.read()).status)
        print("drain:", figures)
        assert figures["problems"] == []
        assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_drain_ends_at_once_when_nothing_is_in_flight(start_mock_core):
    core = await start_mock_core(drain_seconds=30.0)
    started = time.monotonic()
    await core.stop()
    assert time.monotonic() - started < 10.0  # far below the 30 s drain it would otherwise wait


async def test_drain_stops_streams_still_running_at_its_deadline(start_mock_core):
    """A stream longer than --drain-seconds is cut at the deadline: the stop takes no longer."""
    core = await start_mock_core(mock_step_ms=20, drain_seconds=1.0)
    async with grpc.aio.insecure_channel(core.address) as channel:
        stopping = pb.StoppingParams(max_new_tokens=1000, ignore_eos=True)
        stream = spb_grpc.GenerateServiceStub(channel).Generate(spb.GenerateRequest(text="hi", stopping=stopping))
        await stream.read()
        started = time.monotonic()
        await core.stop()
        elapsed = time.monotonic() - started
        stream.cancel()
    assert elapsed < 1.0 + 4.0  # the stream alone would run 20 s; a loaded host adds some


async def test_a_gateway_process_drains_on_sigterm_and_a_second_signal_does_not_cut_it_short(mock_core):
    args = ("lmi", "--port", "0", "--core", mock_core.address, "--drain-seconds", "3")
    proc, port = await start_module("gateways", args, r"on http://127\.0\.0\.1:(\d+)")
    output = asyncio.ensure_future(proc.stdout.read())
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/ping") as r:
                assert r.status == 200
            proc.send_signal(signal.SIGTERM)
            while True:  # health turns at once; the signal is handled between two requests
                async with http.get(f"{base}/ping") as r:
                    if r.status == 503:
                        break
            proc.send_signal(signal.SIGINT)
            async with http.post(f"{base}/invocations", json={"inputs": "x"}) as r:
                assert r.status == 200  # still served while the balancer takes it out
        assert await proc.wait() == 0
        assert (await output).decode().count("draining: health reports not serving for 3.0 s") == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await output
