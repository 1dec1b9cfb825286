"""Disconnect storm, short version: streams through all four gateways abandoned at random points
(before the first byte, after 0-5 records, mid-WebSocket batch). Afterwards the engine has no
request running or waiting, and the next requests are served at once (`make soak` runs 1,000;
scenario in tests/reliability/scenarios.py)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.integration.gateway_helpers import GATEWAYS
from tests.reliability.scenarios import next_requests_start, storm

pytestmark = pytest.mark.timeout(120)

STREAMS = 48


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
    urls = {name: await start_gateway(name, core=core.address) for name in GATEWAYS}
    await storm(urls, STREAMS, random.Random(7))
    assert await engine_idle(core, 5.0), core.engine.stats()
    # Scheduled at once: a leaked slot would hold one of these four back behind the batch of 4.
    assert await next_requests_start(urls) < 5.0
