"""Disconnect storm, short version: streams through all four gateways abandoned at random points
(before the first byte, after 0-5 records, mid-WebSocket batch). Afterwards the engine has no
request running or waiting, and the next request is served at once (`make soak` runs 1,000)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import aiohttp
import pytest
from websockets.asyncio.client import connect

pytestmark = pytest.mark.timeout(120)

STREAMS = 48
LONG = 2000  # tokens: no stream ends on its own during the storm


async def _http_stream(http: aiohttp.ClientSession, url: str, body: dict, records: int) -> None:
    async with http.post(url, json=body) as resp:
        for _ in range(records):
            await resp.content.readline()


async def _ws_stream(url: str, frames: int) -> None:
    async with connect(url) as ws:
        prompts = [{"request_id": str(i), "prompt": "Hello"} for i in range(3)]
        await ws.send(json.dumps({"prompts": prompts, "generation_config": {"max_new_tokens": LONG}}))
        for _ in range(frames):
            await ws.recv()


async def storm(urls: dict[str, str], streams: int, rng: random.Random) -> int:
    """Start `streams` streams across the gateways and abandon each at a random point; returns
    how many were abandoned before their first byte."""
    chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": LONG}
    targets = [
        lambda http, k: _http_stream(http, urls["openai"] + "/v1/chat/completions", chat, k),
        lambda http, k: _http_stream(
            http,
            urls["lmi"] + "/invocations",
            {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": LONG}},
            k,
        ),
        lambda http, k: _http_stream(
            http, urls["triton"] + "/v2/models/mock/generate_stream", {"text_input": "hi", "max_tokens": LONG}, k
        ),
        lambda http, k: _ws_stream(urls["ws"].replace("http", "ws") + "/ws", k),
    ]
    early = 0

    async def abandon(target, http: aiohttp.ClientSession, records: int, after: float) -> None:
        # After `records` records, or `after` seconds (a queued request sends nothing yet).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(after):
                await target(http, records)

    async with aiohttp.ClientSession() as http:
        tasks = []
        for i in range(streams):
            task = asyncio.create_task(abandon(targets[i % len(targets)], http, rng.randint(0, 5), rng.random()))
            if rng.random() < 0.2:  # before the first byte
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
                early += 1
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)
    return early


async def engine_idle(core, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stats = core.engine.stats()
        if stats.active == 0 and stats.queued == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_abandoned_streams_leave_no_request_behind(start_mock_core, start_gateway):
    core = await start_mock_core(mock_step_ms=5, max_batch_size=4)
    urls = {name: await start_gateway(name, core=core.address) for name in ("openai", "lmi", "triton", "ws")}
    await storm(urls, STREAMS, random.Random(7))
    assert await engine_idle(core, 5.0), core.engine.stats()
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(urls["openai"] + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert time.monotonic() - started < 5.0  # scheduled at once: no leaked slot holds the batch of 4
