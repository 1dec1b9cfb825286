"""A gateway's connections bounded (gateways.common.connections), on real sockets: a connection
that never completes its first request's headers is closed after --header-timeout; beyond
--max-connections a new connection is answered 503 with Retry-After and closed, and served
again once one closes; at the file descriptor limit (a gateway process with a low
RLIMIT_NOFILE) the accept loop's errors are logged at most once per interval and counted, and
the gateway serves again once connections close."""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import sys

import aiohttp
import pytest

from gateways.common.config import load
from gateways.common.connections import default_max_connections
from tests.integration.core_helpers import wait_for

pytestmark = pytest.mark.timeout(120)

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection without answering (EOF, or a reset)."""
    try:
        return await reader.read(1) == b""
    except ConnectionResetError:
        return True


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


async def test_a_connection_that_never_sends_its_headers_is_closed(start_gateway):
    url = await start_gateway("openai", header_timeout=0.3)
    silent = await asyncio.open_connection(*_address(url))
    partial = await asyncio.open_connection(*_address(url))
    partial[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
    try:
        assert await closed_by_server(silent[0])
        assert await closed_by_server(partial[0])
    finally:
        silent[1].close()
        partial[1].close()
    assert await metric(url, "trellis_gateway_header_timeouts_total") == 2
    # A request whose headers arrive in time is served, and its connection kept alive.
    reader, writer = await asyncio.open_connection(*_address(url))
    try:
        writer.write(HEALTH)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_connections_beyond_the_cap_are_refused_with_503(start_gateway):
    url = await start_gateway("openai", max_connections=2, header_timeout=0)
    held = [await asyncio.open_connection(*_address(url)) for _ in range(2)]
    reader, writer = await asyncio.open_connection(*_address(url))
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nRetry-After: 1\r\n" in answer and b"--max-connections" in answer
    held[0][1].close()
    held[1][1].write(HEALTH)  # a held connection is served as usual
    assert (await held[1][0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    held[1][1].close()

    async def served() -> bool:
        r, w = await asyncio.open_connection(*_address(url))
        try:
            w.write(HEALTH)
            return (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return False
        finally:
            w.close()

    while not await served():  # noqa: ASYNC110 (the server sees the closes a moment later)
        await asyncio.sleep(0.05)
    assert await metric(url, "trellis_gateway_refused_connections_total") >= 1


def test_the_default_cap_stays_below_the_descriptor_limit():
    assert default_max_connections(1024) == 768
    assert default_max_connections(128) == 64
    assert default_max_connections(10) == 1
    assert default_max_connections(resource.RLIM_INFINITY) == 65536


@pytest.mark.parametrize("flag", ["--header-timeout=-1", "--max-connections=-1", "--accept-error-log-interval=-1"])
def test_a_negative_connection_flag_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit):
        load("openai", 0, lambda p: None, [flag], {})
    assert flag.split("=")[0] + " must be >= 0" in capsys.readouterr().err


FD_LIMIT = 64


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


async def test_the_accept_loop_at_the_descriptor_limit_logs_at_most_once_per_interval():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateways",
        "openai",
        "--core",
        "127.0.0.1:1",
        "--port",
        "0",
        "--max-connections",
        "100000",
        "--header-timeout",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=_low_fd_limit,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    url = ""
    while not url:
        line = (await proc.stdout.readline()).decode()
        assert line, "".join(lines)
        lines.append(line)
        if found := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            url = found.group(1)
    seen = len(lines)

    async def copy() -> None:
        assert proc.stdout is not None
        while line := (await proc.stdout.readline()).decode():
            lines.append(line)

    copier = asyncio.create_task(copy())
    held = []
    try:
        for _ in range(2 * FD_LIMIT):  # the kernel completes handshakes the gateway cannot accept
            with contextlib.suppress(OSError, TimeoutError):
                held.append(await asyncio.wait_for(asyncio.open_connection(*_address(url)), 2))

        def errors() -> list[str]:
            return [line for line in lines[seen:] if "out of system resource" in line]

        await wait_for(lambda: len(errors()) >= 1)
        await asyncio.sleep(3)  # the loop retries accept() all along: three intervals' worth
        assert 1 <= len(errors()) <= 6, "".join(lines[seen:])[-3000:]
        assert "Traceback" not in "".join(lines[seen:])
        assert proc.returncode is None
        for _, writer in held:
            writer.close()
        async with aiohttp.ClientSession() as http:
            while True:  # once descriptors are free again, the gateway accepts and serves
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        if resp.status in (200, 503):
                            break
                await asyncio.sleep(0.2)
            assert await metric(url, "trellis_gateway_accept_errors_total") >= len(errors())
    finally:
        for _, writer in held:
            writer.close()
        proc.terminate()
        await proc.wait()
        copier.cancel()
