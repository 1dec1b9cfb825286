"""What one client can do to a gateway that everyone else shares: compressed bodies that expand
past the limit, bodies the gateway refuses without reading, corrupt encodings, and connections
left idle. Real gateways on the shared mock core, raw sockets where a client library would hide
what the server does."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import pytest

from gateways.common.config import GatewayConfig

pytestmark = pytest.mark.timeout(120)

CHAT = b'{"model":"mock","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
JSON = {"Content-Type": "application/json"}
#: Each HTTP gateway's generation route, a body it serves, where its errors keep the message,
#: and its status for a body it cannot read (DJL answers 424).
ROUTES = {
    "openai": ("/v1/chat/completions", CHAT, lambda b: b["error"]["message"], 400),
    "lmi": ("/invocations", b'{"inputs":"hi","parameters":{"max_new_tokens":2}}', lambda b: b["error"], 424),
    "triton": ("/v2/models/mock/generate", b'{"text_input":"hi","max_tokens":2}', lambda b: b["error"], 400),
}
#: A body a refusing gateway must never wait for: declared this long, only its first KiB sent.
DECLARED = 64 * 1024 * 1024
#: The gateways' --max-body-bytes (the default).
LIMIT = GatewayConfig.max_body_bytes


@pytest.fixture(scope="module")
async def gateways(mock_core, start_gateway):
    """One gateway of each HTTP kind, and an OpenAI gateway that requires an API key."""
    core = mock_core.address
    urls = {name: await start_gateway(name, core=core) for name in ROUTES}
    urls["keyed"] = await start_gateway("openai", core=core, api_key=("sk-test",))
    return urls


async def _raw(url: str, head: str, body: bytes) -> tuple[bytes, bool]:
    """Send `head` and `body` on a fresh connection and read the answer; returns the response
    head and whether the server closed the connection after it (EOF within 5 s: the gateway
    lingers LINGER_S, aiohttp's default 10 s)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        response = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line.split(b":")[1] for line in response.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        await reader.readexactly(length)
        try:
            closed = await asyncio.wait_for(reader.read(1), timeout=5) == b""
        except TimeoutError:
            closed = False
        return response, closed
    finally:
        writer.close()


def _head(path: str, length: int, encoding: str | None = None, extra: str = "") -> str:
    enc = f"Content-Encoding: {encoding}\r\n" if encoding else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{enc}{extra}"
        f"Content-Length: {length}\r\n\r\n"
    )


class _CountingInflater:
    """A zlib decompression object that adds the bytes it puts out to `counter[0]`."""

    def __init__(self, inner, counter: list[int]):
        self._inner = inner
        self._counter = counter

    def decompress(self, data, max_length: int = 0) -> bytes:
        out = self._inner.decompress(data, max_length)
        self._counter[0] += len(out)
        return out

    def flush(self, *args) -> bytes:
        out = self._inner.flush(*args)
        self._counter[0] += len(out)
        return out

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


async def test_a_compressed_body_expanding_past_the_limit_is_413(gateways, monkeypatch):
    """A gzip body of 64 MiB of zeros (about 64 KiB on the wire) expands past --max-body-bytes:
    413, having inflated no more than the limit and a byte. Every inflater in the process (the
    gateway's, and aiohttp's had it decoded the body) counts what it puts out."""
    inflated = [0]
    decompressobj = zlib.decompressobj
    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: _CountingInflater(decompressobj(*a, **k), inflated))
    bomb = gzip.compress(b"0" * DECLARED, compresslevel=9)
    response, _ = await _raw(gateways["openai"], _head("/v1/chat/completions", len(bomb), "gzip"), bomb)
    assert response.startswith(b"HTTP/1.1 413")
    assert 0 < inflated[0] <= LIMIT + 1, inflated[0]


@pytest.mark.parametrize("gateway", ["keyed"])
async def test_a_request_refused_without_reading_its_body_closes_the_connection(gateways, gateway):
    """401 (no API key) for a request whose body is mostly unsent: answered at once, and the
    connection closed after LINGER_S rather than the body waited for."""
    response, closed = await _raw(gateways[gateway], _head("/v1/chat/completions", DECLARED), b"{" * 1024)
    assert response.startswith(b"HTTP/1.1 401")
    assert closed


async def test_an_unknown_path_with_an_unsent_body_closes_the_connection(gateways):
    response, closed = await _raw(gateways["openai"], _head("/v1/nothing", DECLARED), b"{" * 1024)
    assert response.startswith(b"HTTP/1.1 404")
    assert closed


async def test_a_read_body_keeps_the_connection_alive(gateways):
    """Keep-alive is untouched for a request whose body was read."""
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(gateways["openai"] + "/v1/chat/completions", data=CHAT, headers=JSON) as resp:
                assert resp.status == 200
                await resp.read()
        assert len(http.connector._conns) == 1  # type: ignore[union-attr]  # one connection reused


async def _post(url: str, body: bytes, encoding: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=body, headers={**JSON, "Content-Encoding": encoding}) as resp,
    ):
        return resp.status, json.loads(await resp.read())


@pytest.mark.parametrize("gateway", sorted(ROUTES))
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "gzip, identity"])
async def test_a_compressed_body_is_served(gateways, gateway, encoding):
    path, body, _, _ = ROUTES[gateway]
    status, _ = await _post(
        gateways[gateway] + path, gzip.compress(body) if "gzip" in encoding else zlib.compress(body), encoding
    )
    assert status == 200


@pytest.mark.parametrize("gateway", sorted(ROUTES))
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_corrupt_compressed_body_is_a_client_error_in_the_schemas_shape(gateways, gateway, encoding):
    path, body, error_of, bad_input = ROUTES[gateway]
    corrupt = (gzip.compress(body) if encoding == "gzip" else zlib.compress(body))[:-6] + b"garbage"
    status, answer = await _post(gateways[gateway] + path, corrupt, encoding)
    assert status == bad_input
    assert f"could not be decoded as {encoding}" in error_of(answer)


async def test_a_truncated_compressed_body_is_a_client_error(gateways):
    path, body, error_of, _ = ROUTES["openai"]
    status, answer = await _post(gateways["openai"] + path, gzip.compress(body)[:-4], "gzip")
    assert status == 400
    assert "truncated or has trailing data" in error_of(answer)


@pytest.mark.parametrize("gateway", sorted(ROUTES))
async def test_a_body_decompressing_past_the_limit_is_413_in_the_schemas_shape(gateways, gateway):
    path, _, error_of, _ = ROUTES[gateway]
    status, answer = await _post(gateways[gateway] + path, gzip.compress(b" " * (2 * 1024 * 1024 + 1)), "gzip")
    assert status == 413
    assert "larger than the limit" in error_of(answer)


async def test_an_unsupported_content_encoding_is_415(gateways):
    path, body, error_of, _ = ROUTES["openai"]
    status, answer = await _post(gateways["openai"] + path, body, "br")
    assert status == 415
    assert "'br' is not supported" in error_of(answer)
