"""One gateway over several cores: the spread over
cores, a core SIGKILLed under load, the core's return without a gateway restart.

The cores run the mock engine (fixed step time, tokens deterministic per seed). Which core
served a request is counted by wrapping each in-process core's `engine.generate`; the killed
core is a real `trellis-core` process, and the core that comes back on its port is in-process,
so that its requests can be counted too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp

from gateways.common.core_client import PROVISIONAL_AGE
from tests.integration.core_helpers import start_core_process


def count_requests(server) -> list[int]:
    """A one-element counter of the requests `server`'s engine was given."""
    counter = [0]
    generate = server.engine.generate

    def counting(request):
        counter[0] += 1
        return generate(request)

    server.engine.generate = counting
    return counter


async def lmi_stream(http: aiohttp.ClientSession, url: str, tokens: int) -> tuple[int, list[dict]]:
    """POST a streamed LMI request; (status, records)."""
    body = {"inputs": "fleet", "parameters": {"max_new_tokens": tokens}, "stream": True}
    async with http.post(url + "/invocations", json=body) as r:
        text = await r.text()
    if r.status != 200:
        return r.status, [json.loads(text)]
    return 200, [json.loads(line) for line in text.splitlines() if line.strip()]


def outcome(status: int, records: list[dict]) -> str:
    """'ok' (complete), 'in-band' (200, then the error record), or 'status <n>'."""
    if status != 200:
        return f"status {status}"
    last = records[-1]
    if "error" in last:
        return "in-band"
    assert last.get("generated_text"), last
    return "ok"


async def settle(http: aiohttp.ClientSession, url: str) -> None:
    """Let a new gateway settle: the streams it opened while connecting to its cores all went to
    the first core that answered, and are replaced after PROVISIONAL_AGE (1 s)."""
    assert [outcome(*await lmi_stream(http, url, 1)) for _ in range(3)] == ["ok"] * 3
    await asyncio.sleep(PROVISIONAL_AGE + 0.2)


async def test_requests_spread_over_three_cores(start_mock_core, start_gateway):
    cores = [await start_mock_core(mock_step_ms=2.0) for _ in range(3)]
    counters = [count_requests(c) for c in cores]
    target = ",".join(c.address for c in cores)
    url = await start_gateway("lmi", core=target)
    async with aiohttp.ClientSession() as http:
        await settle(http, url)
        for c in counters:
            c[0] = 0
        sem = asyncio.Semaphore(16)

        async def one() -> str:
            async with sem:
                return outcome(*await lmi_stream(http, url, 4))

        results = await asyncio.gather(*(one() for _ in range(200)))
    assert results.count("ok") == 200, results
    served = [c[0] for c in counters]
    assert sum(served) == 200
    assert min(served) >= 40, served  # each core at least 20%


async def test_a_killed_core_fails_only_its_started_requests_and_is_used_again(
    tokenizer_only_dir, start_mock_core, start_gateway
):
    """Three core processes; SIGKILL one while 48 requests of ~1 s run: requests started on it
    end with LMI's in-band error record, every other request (the later ones included) completes,
    nothing hangs. A core started again on the killed core's port serves within 10 s, with the
    gateway untouched (its streams live at most --core-stream-max-age 1 s)."""
    args = ("--model", str(tokenizer_only_dir), "--engine", "mock", "--model-name", "mock", "--mock-step-ms", "20")
    procs = []
    try:
        for _ in range(3):
            procs.append(await start_core_process(*args, "--port", "0"))
        target = ",".join(addr for _, addr in procs)
        url = await start_gateway("lmi", core=target, core_stream_max_age=1.0)
        killed, killed_addr = procs[2]
        async with aiohttp.ClientSession() as http:
            await settle(http, url)
            first = [asyncio.ensure_future(lmi_stream(http, url, 50)) for _ in range(48)]
            await asyncio.sleep(0.4)  # every request is generating
            killed.send_signal(signal.SIGKILL)
            await killed.wait()
            later = [asyncio.ensure_future(lmi_stream(http, url, 5)) for _ in range(48)]
            done = await asyncio.wait_for(asyncio.gather(*first, *later), timeout=60)
            first_outcomes = [outcome(*r) for r in done[:48]]
            later_outcomes = [outcome(*r) for r in done[48:]]
            assert later_outcomes.count("ok") == 48, later_outcomes
            assert set(first_outcomes) <= {"ok", "in-band"}, first_outcomes
            # the killed core held about a third of the first requests
            assert 0 < first_outcomes.count("in-band") < 48 * 0.6, first_outcomes

            port = int(killed_addr.rsplit(":", 1)[1])
            back = await start_mock_core(port=port, mock_step_ms=20.0)
            served = count_requests(back)
            t0 = time.monotonic()
            while served[0] == 0:
                assert time.monotonic() - t0 < 10, "the returning core got no request within 10 s"
                results = await asyncio.gather(*(lmi_stream(http, url, 2) for _ in range(6)))
                assert [outcome(*r) for r in results] == ["ok"] * 6
            await back.stop(0)
    finally:
        for proc, _ in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_requests_a_draining_core_refuses_go_to_another(start_mock_core, start_gateway):
    """A core that refuses new requests (draining: UNAVAILABLE before the first message) loses
    none: each is resent to the other core; with --core-retries 0 the refusal reaches the client
    (LMI answers 503)."""
    cores = [await start_mock_core() for _ in range(2)]
    counters = [count_requests(c) for c in cores]
    target = ",".join(c.address for c in cores)
    url = await start_gateway("lmi", core=target)
    strict = await start_gateway("lmi", core=target, core_retries=0)
    async with aiohttp.ClientSession() as http:
        await settle(http, url)
        await settle(http, strict)
        cores[0].servicer.drain()  # refuses every start; health stays SERVING
        served = counters[0][0]
        results = [outcome(*await lmi_stream(http, url, 2)) for _ in range(20)]
        assert results == ["ok"] * 20
        assert counters[0][0] == served
        refused = [outcome(*await lmi_stream(http, strict, 2)) for _ in range(20)]
        assert "status 503" in refused and set(refused) <= {"ok", "status 503"}, refused


async def test_streams_outlive_the_connection_age_and_clients_reconnect(start_mock_core, start_gateway):
    """A core that ages connections out after 0.5 s (GOAWAY) lets the streams on them finish
    within the grace, and the gateway carries on over a new connection."""
    server = await start_mock_core(mock_step_ms=20.0, max_connection_age_seconds=0.5)
    url = await start_gateway("lmi", core=server.address)
    async with aiohttp.ClientSession() as http:
        long = await lmi_stream(http, url, 100)  # 2 s: spans several connection ages
        assert outcome(*long) == "ok" and len(long[1]) == 100
        for _ in range(3):
            await asyncio.sleep(0.6)
            assert outcome(*await lmi_stream(http, url, 2)) == "ok"
