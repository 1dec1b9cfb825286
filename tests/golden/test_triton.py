"""Golden tests of the Triton gateway: the seed's examples (`triton-generate-extension-v1.md`,
`-v2.md`) and the KServe v2 metadata, request -> expected response, on a real core and a real
gateway on loopback.

A case (`tests/golden/triton/<name>.json`) holds the request (method, path, body) and the
expected response: status, content type and either `body` or `events` (the SSE `data:` objects
of generate_stream), in the placeholder dialect of tests/golden/harness.py.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
import pytest_asyncio

from tests.golden.harness import cases, check, load


@pytest_asyncio.fixture(scope="module")
async def base(start_gateway) -> str:
    return await start_gateway("triton")


def sse_events(text: str) -> list[dict]:
    """The `data:` events of an SSE body (no other field kinds are expected)."""
    out = []
    for chunk in text.split("\n\n"):
        chunk = chunk.strip("\n")
        if chunk:
            assert chunk.startswith("data: "), chunk
            out.append(json.loads(chunk[len("data: ") :]))
    return out


@pytest.mark.parametrize("path", cases("triton"), ids=lambda p: p.stem)
async def test_golden(base, path):
    case = load(path)
    req, want = case["request"], case["response"]
    async with aiohttp.ClientSession() as http:
        async with http.request(req["method"], base + req["path"], json=req.get("body")) as resp:
            status, content_type, text = resp.status, resp.headers["Content-Type"], await resp.text()
    got = {"status": status}
    if "events" in want:  # the stream's Content-Type exactly, charset included
        got |= {"content_type": content_type, "events": sse_events(text)}
    else:
        got |= {"content_type": content_type.split(";")[0], "body": json.loads(text)}
    check(path, case, {"response": got})
