"""The `trellis-core` process: start-up output, graceful SIGTERM drain, start-up failures."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from tests.integration.core_helpers import request, start_core_process


async def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(tiny_model_dir):
    proc, addr = await start_core_process("--model", str(tiny_model_dir), "--port", "0", "--drain-seconds", "30")
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = spb_grpc.GenerateServiceStub(channel)
            call = stub.Generate(request({"text": "x", "stopping": {"maxNewTokens": 150, "ignoreEos": True}}))
            while (await call.read()).state != pb.GENERATE_STATE_GENERATING:
                pass
            # Watch from before the signal: once draining, the server takes no new connection.
            health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await health.read()).status == health_pb2.HealthCheckResponse.SERVING
            proc.send_signal(signal.SIGTERM)
            while (await health.read()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                pass  # from here on the core is draining
            refused = stub.Generate(request({"text": "y", "stopping": {"maxNewTokens": 2}}))
            try:
                await refused.read()
                raise AssertionError("a new call was accepted while draining")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
            last = None
            while (msg := await call.read()) is not grpc.aio.EOF:
                last = msg
            assert last.HasField("usage") and last.usage.completion_tokens == 150
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_unusable_model_directory_fails_at_start(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "core",
        "--model",
        str(tmp_path / "missing"),
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode != 0
    assert b"missing" in out
