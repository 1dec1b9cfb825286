"""Helpers for tests that talk to the core over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.types import EngineStats


def request(body: dict[str, Any]) -> spb.GenerateRequest:
    """A GenerateRequest from its proto-JSON form."""
    return json_format.ParseDict(body, spb.GenerateRequest())


def request_of(
    text: str = "hello",
    sampling: Mapping[str, Any] | None = None,
    stopping: Mapping[str, Any] | None = None,
    output: Mapping[str, Any] | None = None,
    bias: Mapping[int, float] | None = None,
    **fields: Any,
) -> spb.GenerateRequest:
    """A GenerateRequest from keyword fields: each params message from a dict of its fields
    (map and repeated fields as dicts and lists), `bias` merged into sampling.logit_bias."""
    sampling = dict(sampling or {})
    sampling["logit_bias"] = {**sampling.get("logit_bias", {}), **(bias or {})}
    return spb.GenerateRequest(
        text=text,
        sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingParams(**(stopping or {})),
        output=pb.OutputOptions(**(output or {})),
        **fields,
    )


async def generate(stub, body: dict[str, Any]) -> list[spb.GenerateResponse]:
    """All messages of one Generate call."""
    return [m async for m in stub.Generate(request(body))]


def sequences(msgs: list[spb.GenerateResponse]) -> dict[int, dict[str, Any]]:
    """Per sequence index: concatenated text, token ids, finish reason, stop info."""
    out: dict[int, dict[str, Any]] = {}
    for m in msgs:
        for o in m.outputs:
            s = out.setdefault(o.index, {"text": "", "ids": [], "tokens": [], "finish": 0, "stop": "", "stop_id": None})
            s["text"] += o.text
            s["ids"] += [t.id for t in o.tokens]
            s["tokens"] += list(o.tokens)
            if o.finish_reason:
                s["finish"] = o.finish_reason
                s["stop"] = o.stop_sequence
                s["stop_id"] = o.stop_token_id if o.HasField("stop_token_id") else None
                s["cumulative"] = o.cumulative_logprob if o.HasField("cumulative_logprob") else None
    return out


def bad_request_field(error: grpc.aio.AioRpcError) -> str | None:
    """The field named by the status's google.rpc.BadRequest detail."""
    status = rpc_status.from_call(error)
    for d in status.details if status else []:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            d.Unpack(bad)
            return bad.field_violations[0].field
    return None


def reason_of(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a failed call ("" without one)."""
    status = rpc_status.from_call(error)
    assert status is not None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll `predicate` until it holds. No time limit of its own: the test's timeout bounds it,
    so a slow machine cannot fail a test that waits for something that does happen."""
    # Polling: the state read here changes on engine threads that signal no asyncio event.
    while not predicate():  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def wait_idle(engine) -> None:
    """Wait until the engine reports no active and no queued request."""
    await wait_for(lambda: idle(engine.stats()))


def idle(stats: EngineStats) -> bool:
    """No request running or queued (whatever the prefix cache holds)."""
    return stats.active == 0 and stats.queued == 0


async def wait_health(address: str, status: int, service: str = "") -> None:
    """Wait until grpc.health.v1 reports `status` for `service` (Watch streams every change)."""
    async with grpc.aio.insecure_channel(address) as channel:
        async for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service)):
            if reply.status == status:
                return


FINISH = pb.FinishReason


async def start_core_process(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start `python -m core *args` on 127.0.0.1 and wait for its "serving ... on host:port" line.

    Returns the process (stdout piped) and the address it serves on; the caller stops it.
    """
    env = {**os.environ, "TRELLIS_CORE_HOST": "127.0.0.1"}
    return await start_module("core", args, r"serving .* on (127\.0\.0\.1:\d+)", env)


async def start_module(
    module: str, args: Sequence[str], pattern: str, env: Mapping[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """Start `python -m module *args` and wait for an output line matching `pattern`.

    Returns the process (stdout piped, stderr into it) and the pattern's first group; the
    caller stops it. Fails with everything the process printed if it exits first.
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env) if env is not None else None,
    )
    lines = []
    while True:
        line = (await proc.stdout.readline()).decode()
        lines.append(line)
        assert line, "".join(lines)
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
