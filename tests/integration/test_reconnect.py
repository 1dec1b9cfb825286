"""Gateways serve again at once when their core comes back after an outage (issue "Defects
found by a hostile run", item 1).

gRPC reconnects with exponential backoff (1 s, growing by 1.6x up to 120 s by default), so after
a long outage a gateway used to wait up to the next attempt, tens of seconds after the core was
back. Gateways now cap the backoff at --core-max-reconnect-backoff-ms (500 ms by default); this
test kills a real core process, keeps it down for several backoff periods, restarts it on the
same port and measures, for each gateway, the time from the core's "serving" line to the first
successful request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
from websockets.asyncio.client import connect

from tests.integration.core_helpers import start_core_process

OUTAGE_S = 4.0


async def lmi(http: aiohttp.ClientSession, base: str) -> bool:
    async with http.post(base + "/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}) as r:
        return r.status == 200


async def openai(http: aiohttp.ClientSession, base: str) -> bool:
    body = {"model": "mock", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        return r.status == 200


async def triton(http: aiohttp.ClientSession, base: str) -> bool:
    async with http.post(base + "/v2/models/mock/generate", json={"text_input": "x", "max_tokens": 1}) as r:
        return r.status == 200


async def ws(http: aiohttp.ClientSession, base: str) -> bool:
    async with connect("ws" + base[len("http") :] + "/ws") as sock:
        body = {"prompts": [{"request_id": "r", "prompt": "x"}], "generation_config": {"max_new_tokens": 1}}
        await sock.send(json.dumps(body))
        while True:
            for event in json.loads(await sock.recv()):
                if event.get("type") in ("COMPLETE", "ERROR"):
                    return bool(event["type"] == "COMPLETE")


async def first_success(probe, http: aiohttp.ClientSession, base: str, since: float) -> float:
    """Seconds from `since` until `probe` succeeds (polled every 50 ms)."""
    while not await probe(http, base):  # noqa: ASYNC110 (polling a remote service)
        await asyncio.sleep(0.05)
    return time.monotonic() - since


async def test_every_gateway_serves_within_a_second_of_the_core_coming_back(tokenizer_only_dir, start_gateway):
    args = ("--model", str(tokenizer_only_dir), "--engine", "mock", "--model-name", "mock", "--mock-step-ms", "2")
    proc, addr = await start_core_process(*args, "--port", "0")
    port = addr.rsplit(":", 1)[1]
    probes = {"lmi": lmi, "openai": openai, "triton": triton, "ws": ws}
    try:
        extra: dict[str, dict] = {"ws": {"env_file": ""}}
        urls = {name: await start_gateway(name, core=addr, **extra.get(name, {})) for name in probes}
        async with aiohttp.ClientSession() as http:
            for name, probe in probes.items():
                assert await probe(http, urls[name]), name
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            # While the core is down every gateway fails fast, and keeps trying to reconnect.
            for name, probe in probes.items():
                assert not await asyncio.wait_for(probe(http, urls[name]), 5), name
            await asyncio.sleep(OUTAGE_S)
            proc, _ = await start_core_process(*args, "--port", port)
            back = time.monotonic()
            took = await asyncio.wait_for(
                asyncio.gather(*(first_success(p, http, urls[n], back) for n, p in probes.items())), 30
            )
        print("seconds to the first success after the core came back:", dict(zip(probes, took, strict=True)))
        # The backoff cap (500 ms, with grpc's 20% jitter) bounds it; a loaded machine adds a little.
        assert max(took) < 2.5, took
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
