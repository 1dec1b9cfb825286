"""Sessions that find their core: a WebSocket gateway over
three cores sends every request of a session to the core that holds it (ring_hash on the
session's bucket, gRFC A76), and a session whose core is gone starts fresh on another.

The cores run the tiny model (greedy is deterministic, and the same on every core); the mock
engine draws a continuation from the whole sequence as a new prompt, so it cannot show that a
continued chain equals one long run.
"""

from __future__ import annotations

import asyncio

import pytest_asyncio
from websockets.asyncio.client import connect

from core.server import start_core
from tests.conftest import core_config
from tests.integration.test_fleet import count_requests
from tests.integration.test_fleet_prefix import generate_only  # noqa: F401 (a fixture)
from tests.integration.test_gateway_ws import batch, check_lifecycle, greedy, run, ws_url

CHAINS = 20
STEPS = 3
TOKENS = 4
PROMPT = "The cat sat on"


@pytest_asyncio.fixture(scope="module")
async def cores(tiny_model_dir):
    """Three cores on the tiny model."""
    servers = [await start_core(core_config(tiny_model_dir, threads=1, engine_process=False)) for _ in range(3)]
    yield servers
    for server in servers:
        await server.stop(0)


async def test_continued_chains_equal_one_long_run_over_three_cores(cores, start_gateway):
    url = await start_gateway("ws", env_file="", core=",".join(c.address for c in cores))
    prompts = [f"{PROMPT} {i}" for i in range(CHAINS)]

    async def chain(i: int) -> tuple[str, str]:
        async with connect(ws_url(url)) as ws:
            text = ""
            for step in range(STEPS):
                prompt = prompts[i] if step == 0 else "ignored on a continued session"
                events = await run(ws, batch((f"chain-{i}", prompt), **greedy(TOKENS)))
                new = events[f"chain-{i}"][3:-1]  # PROGRESS events: this call's new text
                check_lifecycle(events[f"chain-{i}"], max_new_tokens=TOKENS)
                text += "".join(e["text"] for e in new)
            whole = await run(ws, batch((f"whole-{i}", prompts[i]), **greedy(TOKENS * STEPS)))
            return text, "".join(e["text"] for e in whole[f"whole-{i}"][3:-1])

    results = await asyncio.gather(*(chain(i) for i in range(CHAINS)))
    for i, (chained, whole) in enumerate(results):
        assert chained == whole, (i, chained, whole)
    holders = [sum(1 for i in range(CHAINS) if c.servicer.pipeline.sessions.get(f"chain-{i}")) for c in cores]
    assert sum(holders) == CHAINS and max(holders) < CHAINS, holders  # spread, each session on one core


async def test_sessions_find_their_core_over_generate_calls(start_mock_core, start_gateway, generate_only):  # noqa: F811
    """Cores without MultiplexGenerate get one Generate call per request, on the session's
    core alike."""
    cores = [await start_mock_core() for _ in range(3)]
    counters = [count_requests(c) for c in cores]
    addresses = [await generate_only(c) for c in cores]
    url = await start_gateway("ws", env_file="", core=",".join(addresses))
    async with connect(ws_url(url)) as ws:
        for i in range(8):
            before = [c[0] for c in counters]
            for _ in range(STEPS):
                events = await run(ws, batch((f"chain-{i}", PROMPT), **greedy(TOKENS)))
                assert events[f"chain-{i}"][-1]["type"] == "COMPLETE", events
            served = [c[0] - b for c, b in zip(counters, before, strict=True)]
            assert sorted(served) == [0, 0, STEPS], (i, served)
    holders = [sum(1 for i in range(8) if c.servicer.pipeline.sessions.get(f"chain-{i}")) for c in cores]
    assert sum(holders) == 8 and max(holders) < 8, holders


async def test_a_session_whose_core_is_gone_starts_fresh(tiny_model_dir, start_gateway):
    servers = [await start_core(core_config(tiny_model_dir, threads=1, engine_process=False)) for _ in range(2)]
    try:
        url = await start_gateway("ws", env_file="", core=",".join(c.address for c in servers))
        async with connect(ws_url(url)) as ws:
            await run(ws, batch(("gone-1", PROMPT), **greedy(TOKENS)))
            (holder,) = [c for c in servers if c.servicer.pipeline.sessions.get("gone-1")]
            await holder.stop(0)
            again = await run(ws, batch(("gone-1", "A new start"), **greedy(TOKENS)))
            fresh = await run(ws, batch(("gone-fresh", "A new start"), **greedy(TOKENS)))
        got = check_lifecycle(again["gone-1"], max_new_tokens=TOKENS)
        assert got["text"] == check_lifecycle(fresh["gone-fresh"], max_new_tokens=TOKENS)["text"]
    finally:
        for server in servers:
            await server.stop(0)
