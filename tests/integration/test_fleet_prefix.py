"""Prefix-aware routing over three cores (`--routing prefix`): every turn of a conversation,
and every prompt that opens alike, reaches one core; a hot prefix spills to the others under
load; round robin spreads the same turns.

The cores run the mock engine; which core served a request is counted by wrapping each
in-process core's `engine.generate` (tests/integration/test_fleet.py's counter).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest_asyncio
from grpc_health.v1 import health_pb2_grpc

from core.wire import add_generate_service
from tests.conftest import NO_REUSEPORT
from tests.integration.test_fleet import count_requests


async def chat_turns(http: aiohttp.ClientSession, url: str, topic: str, turns: int) -> None:
    """One conversation of `turns` turns, each resending the whole history (OpenAI chat)."""
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": f"About {topic}?"}]
    for turn in range(turns):
        body = {"model": "mock", "messages": messages, "max_tokens": 3}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            reply = (await r.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And then ({turn})?"}]


async def three_cores(start_mock_core, start_gateway, routing: str, **core_options):
    cores = [await start_mock_core(**core_options) for _ in range(3)]
    counters = [count_requests(c) for c in cores]
    url = await start_gateway("openai", core=",".join(c.address for c in cores), routing=routing)
    return counters, url


async def test_each_conversation_stays_on_one_core_with_prefix_routing(start_mock_core, start_gateway):
    counters, url = await three_cores(start_mock_core, start_gateway, "prefix")
    homes = []
    async with aiohttp.ClientSession() as http:
        for topic in ("ships", "trains", "bees", "tides", "salt", "maps", "glass", "owls", "clay"):
            before = [c[0] for c in counters]
            await chat_turns(http, url, topic, 4)
            served = [c[0] - b for c, b in zip(counters, before, strict=True)]
            assert sorted(served) == [0, 0, 4], (topic, served)
            homes.append(served.index(4))
        # A second visit of the same conversation (its opening) lands where the first did.
        before = [c[0] for c in counters]
        await chat_turns(http, url, "ships", 2)
        assert [c[0] - b for c, b in zip(counters, before, strict=True)][homes[0]] == 2
    assert len(set(homes)) > 1, homes  # nine openings do not all hash to one core


class _WithoutMultiplex:
    """A core's servicer whose MultiplexGenerate answers UNIMPLEMENTED with grpc's own words
    for a method a server lacks."""

    def __init__(self, servicer):
        self._servicer = servicer

    def __getattr__(self, name: str):
        return getattr(self._servicer, name)

    async def MultiplexGenerate(self, requests, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


@pytest_asyncio.fixture
async def generate_only() -> AsyncIterator:
    """Factory: `await generate_only(core)` serves `core`'s GenerateService and health on a
    second port, without MultiplexGenerate (answered UNIMPLEMENTED, as by a core that predates
    it); returns the address."""
    servers: list[grpc.aio.Server] = []

    async def factory(core) -> str:
        server = grpc.aio.server(options=NO_REUSEPORT)
        servicer = _WithoutMultiplex(core.servicer)
        add_generate_service(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(core.health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield factory
    for server in servers:
        await server.stop(0)


async def test_conversations_stay_on_one_core_over_generate_calls(start_mock_core, start_gateway, generate_only):
    """Cores without MultiplexGenerate get one Generate call per request, routed alike."""
    cores = [await start_mock_core() for _ in range(3)]
    counters = [count_requests(c) for c in cores]
    addresses = [await generate_only(c) for c in cores]
    url = await start_gateway("openai", core=",".join(addresses), routing="prefix")
    homes = []
    async with aiohttp.ClientSession() as http:
        for topic in ("ships", "trains", "bees", "tides", "salt", "maps"):
            before = [c[0] for c in counters]
            await chat_turns(http, url, topic, 4)
            served = [c[0] - b for c, b in zip(counters, before, strict=True)]
            assert sorted(served) == [0, 0, 4], (topic, served)
            homes.append(served.index(4))
    assert len(set(homes)) > 1, homes


async def test_round_robin_spreads_a_conversation(start_mock_core, start_gateway):
    counters, url = await three_cores(start_mock_core, start_gateway, "round_robin")
    async with aiohttp.ClientSession() as http:
        for _ in range(3):  # let the pool open a stream per core
            await chat_turns(http, url, "warm-up", 1)
        await asyncio.sleep(1.2)  # the streams opened while connecting expire (PROVISIONAL_AGE)
        before = [c[0] for c in counters]
        for topic in ("ships", "trains", "bees"):
            await chat_turns(http, url, topic, 6)
    served = [c[0] - b for c, b in zip(counters, before, strict=True)]
    assert sum(served) == 18 and sum(1 for s in served if s) > 1, served


async def test_a_hot_prefix_spills_to_other_cores_under_load(start_mock_core, start_gateway):
    counters, url = await three_cores(start_mock_core, start_gateway, "prefix", mock_step_ms=20.0)
    header = "Answer like the examples. " * 20  # one few-shot header: one key (256 characters)
    async with aiohttp.ClientSession() as http:

        async def one(i: int) -> None:
            body = {"model": "mock", "prompt": f"{header} item {i}", "max_tokens": 8}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(one(i) for i in range(24)))
        served = [c[0] for c in counters]
        # 24 at once: the header's core takes up to ceil(1.25 * n / 3) as they arrive, the rest
        # go on along the ring.
        assert sum(served) == 24 and max(served) <= 12 and sum(1 for s in served if s) >= 2, served
        for c in counters:
            c[0] = 0
        for i in range(4):  # one at a time: all at home
            await one(i)
        assert sorted(c[0] for c in counters) == [0, 0, 4]
