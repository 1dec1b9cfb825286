"""haproxy in front of two gateway processes: SIGTERM one under load, and no request fails.
The gateway drains (gateways.common.drain): health 503
first, so haproxy's checks take it out of rotation while it still serves; then its listener
closes and the requests in flight finish. (haproxy's `retries` with `option redispatch` would
also resend a request refused by a closed port; the drain is what a balancer without retries
needs.)

haproxy is Debian's package, installed by `make system-deps` (part of `make test`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket

import aiohttp
import pytest

from tests.integration.core_helpers import start_module

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (make system-deps installs it)")

CONFIG = """
global
    maxconn 512
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout check 3s
    retries 2
    option redispatch
frontend trellis
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /ping
    http-check expect status 200
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Readers that keep the gateways' output pipes drained.
_READERS: set[asyncio.Future[bytes]] = set()


async def start_gateway_process(core: str) -> tuple[asyncio.subprocess.Process, int]:
    """An LMI gateway process on a free port (draining 2 s on SIGTERM); its output is drained."""
    args = ("lmi", "--port", "0", "--core", core, "--drain-seconds", "2")
    proc, port = await start_module("gateways", args, r"on http://127\.0\.0\.1:(\d+)")
    reader = asyncio.ensure_future(proc.stdout.read())
    _READERS.add(reader)
    reader.add_done_callback(_READERS.discard)
    return proc, int(port)


async def test_a_gateway_stopped_under_load_loses_no_request(mock_core, tmp_path):
    procs: list[asyncio.subprocess.Process] = []
    haproxy = None
    try:
        ports = []
        for _ in range(2):
            proc, port = await start_gateway_process(mock_core.address)
            procs.append(proc)
            ports.append(port)
        front = free_port()
        servers = "\n".join(
            f"    server g{i} 127.0.0.1:{p} check inter 100ms fall 3 rise 1" for i, p in enumerate(ports)
        )
        (tmp_path / "haproxy.cfg").write_text(CONFIG.format(port=front, servers=servers))
        haproxy = await asyncio.create_subprocess_exec(
            HAPROXY, "-db", "-f", str(tmp_path / "haproxy.cfg"), stdout=asyncio.subprocess.DEVNULL
        )
        url = f"http://127.0.0.1:{front}/invocations"
        async with aiohttp.ClientSession() as http:
            while True:  # haproxy up and both gateways checked healthy
                try:
                    async with http.post(url, json={"inputs": "x", "parameters": {"max_new_tokens": 1}}) as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            statuses: list[int] = []
            stop = asyncio.Event()

            async def client() -> None:
                body = {"inputs": "load", "parameters": {"max_new_tokens": 30}}
                while not stop.is_set():
                    async with http.post(url, json=body) as r:
                        await r.read()
                        statuses.append(r.status)

            clients = [asyncio.ensure_future(client()) for _ in range(8)]
            await asyncio.sleep(1.0)
            before = len(statuses)
            procs[0].send_signal(signal.SIGTERM)
            # Draining: health says 503 at once, requests sent to it directly are still served.
            direct = f"http://127.0.0.1:{ports[0]}"
            while True:
                async with http.get(direct + "/ping") as r:
                    if r.status == 503:
                        break
                await asyncio.sleep(0.05)
            async with http.post(direct + "/invocations", json={"inputs": "x"}) as r:
                assert r.status == 200
            assert await asyncio.wait_for(procs[0].wait(), 30) == 0
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 30)
        assert before > 0 and len(statuses) > before
        assert statuses == [200] * len(statuses), [s for s in statuses if s != 200]
    finally:
        if haproxy is not None and haproxy.returncode is None:
            haproxy.terminate()
            await haproxy.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
