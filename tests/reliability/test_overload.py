"""Overload is refused at once, in each schema's shape, with a hint to come back: a core whose
queue takes nothing (mock engine, --max-queue-size 0) answers RESOURCE_EXHAUSTED, which is
429 + Retry-After on OpenAI and Triton, DJL's 503 + Retry-After on LMI, and an ERROR event that
says to retry on WebSocket."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from websockets.asyncio.client import connect

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
async def full(start_mock_core, start_gateway):
    core = await start_mock_core(max_queue_size=0)
    urls = {name: await start_gateway(name, core=core.address) for name in ("openai", "lmi", "triton", "ws")}
    urls["lmi-slow-retry"] = await start_gateway("lmi", core=core.address, retry_after_seconds=7)
    return urls


@pytest.mark.parametrize(
    "gateway, path, body, status",
    [
        ("openai", "/v1/chat/completions", {"model": "mock", "messages": HI}, 429),
        ("openai", "/v1/chat/completions", {"model": "mock", "messages": HI, "stream": True}, 429),
        ("triton", "/v2/models/mock/generate", {"text_input": "hi"}, 429),
        ("triton", "/v2/models/mock/generate_stream", {"text_input": "hi"}, 429),
        ("lmi", "/invocations", {"inputs": "hi"}, 503),
        ("lmi", "/invocations", {"messages": HI}, 503),
    ],
)
async def test_a_full_queue_is_refused_with_retry_after(full, gateway, path, body, status):
    async with aiohttp.ClientSession() as http, http.post(full[gateway] + path, json=body) as resp:
        assert resp.status == status, await resp.text()
        assert resp.headers["Retry-After"] == "1"
        assert "retry" in (await resp.text()).lower()


async def test_retry_after_is_configurable(full):
    async with (
        aiohttp.ClientSession() as http,
        http.post(full["lmi-slow-retry"] + "/invocations", json={"inputs": "hi"}) as r,
    ):
        assert (r.status, r.headers["Retry-After"]) == (503, "7")


async def test_a_full_queue_is_an_error_event_with_a_retry_hint_on_websocket(full):
    async with connect(full["ws"].replace("http", "ws") + "/ws") as ws:
        await ws.send(json.dumps({"prompts": [{"request_id": "a", "prompt": "hi"}]}))
        events = json.loads(await ws.recv())
    assert events[-1]["type"] == "ERROR"
    assert "retry later" in events[-1]["error"]


async def test_a_request_waits_no_longer_than_the_queue_timeout(start_mock_core, start_gateway):
    """One request holds the only batch slot; the next waits --queue-timeout (0.3 s), then gets
    504 (DEADLINE_EXCEEDED, code queue_timeout) in the schema's shape, and the core drops it."""
    core = await start_mock_core(max_batch_size=1, mock_step_ms=10)
    urls = {
        name: await start_gateway(name, core=core.address, queue_timeout=0.3) for name in ("openai", "triton", "ws")
    }
    hold = {"model": "mock", "messages": HI, "max_tokens": 1000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(urls["openai"] + "/v1/chat/completions", json=hold) as held:
        await held.content.readline()
        r = await http.post(urls["openai"] + "/v1/chat/completions", json={"model": "mock", "messages": HI})
        assert r.status == 504
        assert (await r.json())["error"]["code"] == "queue_timeout"
        r = await http.post(urls["triton"] + "/v2/models/mock/generate", json={"text_input": "hi"})
        assert r.status == 504
        assert "--queue-timeout" in (await r.json())["error"]
        async with connect(urls["ws"].replace("http", "ws") + "/ws") as ws:
            await ws.send(json.dumps({"prompts": [{"request_id": "w", "prompt": "hi"}]}))
            events: list[dict] = []
            while not events or events[-1]["type"] not in ("COMPLETE", "ERROR"):
                events += json.loads(await ws.recv())
        assert events[-1]["type"] == "ERROR" and "--queue-timeout" in events[-1]["error"]
        for _ in range(100):  # the cancels reach the engine within a step or two
            if core.engine.stats().queued == 0:
                break
            await asyncio.sleep(0.02)
        assert core.engine.stats().queued == 0
