"""Core killed mid-stream (SIGKILL of a real core process, mock engine) under all four gateways
at once, with a stream in flight through each: every schema renders its in-band error, the
readiness routes report not ready while the core is down, and after the core restarts on the
same address every gateway serves again without a restart of its own (`make soak` records the
times; scenario in tests/reliability/scenarios.py).

The outage lasts several reconnect-backoff periods: gRPC reconnects with exponential backoff
(1 s growing by 1.6x up to 120 s by default), so after a long outage a gateway used to wait for
its next attempt, tens of seconds after the core was back. Gateways cap the backoff at
--core-max-reconnect-backoff-ms (500 ms by default), which bounds the time to the first success.
"""

from __future__ import annotations

import signal

import pytest

from tests.integration.core_helpers import start_core_process
from tests.integration.gateway_helpers import GATEWAYS
from tests.reliability.scenarios import core_kill

pytestmark = pytest.mark.timeout(120)

OUTAGE_S = 4.0


async def test_a_killed_core_is_reported_in_band_and_served_again_once_back(tokenizer_only_dir, start_gateway):
    args = ("--model", str(tokenizer_only_dir), "--engine", "mock", "--model-name", "mock", "--mock-step-ms", "5")
    proc, addr = await start_core_process(*args, "--port", "0")
    port = addr.rsplit(":", 1)[1]

    async def kill() -> None:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    async def restart() -> None:
        nonlocal proc
        proc, _ = await start_core_process(*args, "--port", port)

    try:
        extra: dict[str, dict] = {"ws": {"env_file": ""}}
        urls = {name: await start_gateway(name, core=addr, **extra.get(name, {})) for name in GATEWAYS}
        figures = await core_kill(urls, kill, restart, OUTAGE_S)
        print("core kill:", figures)
        assert figures["problems"] == []
        # The backoff cap (500 ms, with grpc's 20% jitter) bounds it; a loaded machine adds a little.
        assert max(figures["recovery_s"].values()) < 2.5, figures
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
