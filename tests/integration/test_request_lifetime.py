"""A request's objects go when it ends: reference counting frees them, none waits for the cyclic
garbage collector.

Serving processes raise the collector's young threshold and freeze their start-up heap
(servegc), which pays only while requests leave no reference cycle behind: a cycle's objects
would wait for a collection, and a full one walks every live request. Here, with the collector
off, requests streamed through every gateway into the core, finished or cut short by the
client, must leave no gateway CoreCall or ResponseWriter and no core Job or OutputStream
behind. (A request that fails keeps its error's traceback, a cycle through its frames; it dies
young, so a young collection frees it without walking the older heap.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import pytest_asyncio
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

import servegc
from core.engine.base import OutputStream
from core.pipeline import Job
from gateways.common.core_call import CoreCall
from gateways.common.writer import ResponseWriter
from tests.integration.core_helpers import generate, wait_idle

TRACKED = (CoreCall, ResponseWriter, Job, OutputStream)


@pytest_asyncio.fixture(scope="module")
async def urls(mock_core, start_gateway) -> dict[str, str]:
    names = ("lmi", "openai", "triton", "ws")
    options = {"ws": {"env_file": ""}}
    return {n: await start_gateway(n, core=mock_core.address, **options.get(n, {})) for n in names}


STREAMS = [
    ("lmi", "/invocations", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 8}}),
    (
        "openai",
        "/v1/chat/completions",
        {"model": "mock", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 8},
    ),
    (
        "openai",
        "/v1/chat/completions",
        {
            "model": "mock",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("triton", "/v2/models/mock/generate_stream", {"text_input": "Hello", "parameters": {"max_tokens": 8}}),
]


async def test_finished_streams_leave_nothing_for_the_collector(collector_off, mock_core, urls):
    async with aiohttp.ClientSession() as session:
        for name, path, body in STREAMS:
            async with session.post(urls[name] + path, json=body) as r:
                assert r.status == 200, name
                assert await r.read(), name
    async with connect(urls["ws"].replace("http", "ws") + "/ws") as ws:
        frame = {"prompts": [{"request_id": "a", "prompt": "Hi"}], "generation_config": {"max_new_tokens": 8}}
        await ws.send(json.dumps(frame))
        while json.loads(await ws.recv())[-1]["type"] not in ("COMPLETE", "ERROR"):
            pass
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        await generate(spb_grpc.GenerateServiceStub(channel), {"text": "Hi", "stopping": {"maxNewTokens": 8}})
    await wait_idle(mock_core.engine)
    assert await collector_off(*TRACKED) == []


def left_by_this_request(marker: str) -> Callable[[Any], bool]:
    """Whether a tracked object belongs to the request whose prompt holds `marker`: its
    CoreCall, or a ResponseWriter of a connection that closed (a writer of a connection still
    open serves someone else); core objects count whoever made them."""

    def mine(o: Any) -> bool:
        if isinstance(o, CoreCall):
            return marker in o.request.text
        if isinstance(o, ResponseWriter):
            return o._protocol is None or o._protocol.transport is None
        return True

    return mine


async def test_a_stream_the_client_left_leaves_nothing_for_the_collector(collector_off, mock_core, urls):
    marker = "left-" + uuid.uuid4().hex
    body = {"inputs": marker, "stream": True, "parameters": {"max_new_tokens": 200, "ignore_eos_token": True}}
    async with aiohttp.ClientSession() as session:
        async with session.post(urls["lmi"] + "/invocations", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # one token, then the client goes away
    await wait_idle(mock_core.engine)
    assert await collector_off(*TRACKED, mine=left_by_this_request(marker)) == []


def test_settle_freezes_the_start_up_heap_and_raises_the_young_threshold():
    """In a fresh interpreter: the pytest process keeps CPython's defaults."""
    code = "import gc, servegc; servegc.settle(); print(gc.get_freeze_count() > 1000, *gc.get_threshold())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", str(servegc.GEN0_THRESHOLD), "10", "10"]
