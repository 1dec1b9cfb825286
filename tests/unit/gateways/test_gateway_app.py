"""The gateway contract (gateways/common/app.py): settings on their AppKey, routes from
add_routes, and the error middleware that renders every error around the handlers in the
schema's shape, on a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateways.common import app as app_module
from gateways.common.app import INTERNAL_ERROR, make_gateway_app, read_json, start_app
from gateways.common.config import GatewayConfig
from gateways.common.status import GatewayError


@dataclass(frozen=True)
class _Settings:
    greeting: str = "hi"


KEY = web.AppKey("test_settings", _Settings)


def _render(request: web.Request, status: int, message: str) -> web.Response:
    return web.json_response({"shape": "schema", "status": status, "message": message}, status=status)


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"greeting": request.app[KEY].greeting})


async def _echo(request: web.Request) -> web.Response:
    try:
        body = await read_json(request, param="body", empty="send something")
    except GatewayError as e:
        return web.json_response({"error": e.message, "param": e.param}, status=400)
    return web.json_response(body)


async def _bug(request: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def _bug_after_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"partial")
    raise RuntimeError("a bug after the status line")


def _document(config: GatewayConfig, settings: _Settings) -> dict[str, object]:
    return {"openapi": "3.1.0", "info": {"title": settings.greeting, "version": "0"}, "paths": {}}


def _routes(app: web.Application) -> None:
    app.router.add_get("/hello", _hello)
    app.router.add_post("/echo", _echo)
    app.router.add_get("/bug", _bug)
    app.router.add_get("/bug-after-start", _bug_after_start)


@pytest_asyncio.fixture(scope="module")
async def base() -> AsyncIterator[str]:
    config = GatewayConfig(name="test", core="127.0.0.1:1", max_body_bytes=64)
    app = make_gateway_app(
        config, KEY, _Settings(greeting="hello"), render_error=_render, add_routes=_routes, openapi=_document
    )
    runner, port = await start_app(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _call(method: str, url: str, data: bytes | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.request(method, url, data=data) as resp:
        return resp.status, await resp.json()


async def test_settings_and_routes(base):
    assert await _call("GET", base + "/hello") == (200, {"greeting": "hello"})


async def test_the_openapi_document_is_built_from_the_settings_and_served(base):
    status, doc = await _call("GET", base + "/openapi.json")
    assert status == 200 and doc["info"]["title"] == "hello"


@pytest.mark.parametrize(
    ("method", "path", "data", "status", "message"),
    [
        ("GET", "/nothing", None, 404, "Not Found: GET /nothing"),
        ("POST", "/hello", None, 405, "Method Not Allowed: POST /hello"),
        ("POST", "/echo", b"[" + b"1," * 40 + b"1]", 413, "The request body is larger than the limit of 64 bytes."),
        ("GET", "/bug", None, 500, INTERNAL_ERROR),
    ],
)
async def test_errors_around_the_handlers_are_in_the_schemas_shape(base, method, path, data, status, message):
    assert await _call(method, base + path, data) == (
        status,
        {"shape": "schema", "status": status, "message": message},
    )


async def test_a_405_in_the_schemas_shape_keeps_the_allow_header(base):
    """RFC 9110 section 15.5.6: a 405 lists the methods the resource has (schemathesis'
    unsupported_method check found it missing after the error middleware re-rendered the 405)."""
    async with aiohttp.ClientSession() as http, http.delete(base + "/hello") as resp:
        assert resp.status == 405
        assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD"}


@pytest.mark.parametrize(
    "raw",
    [
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00",  # a gRPC client's preface
        b"GET /hello HTTP/1.1\r\nBad Header Line\r\n\r\n",
    ],
)
async def test_a_request_that_is_not_http_1_is_one_info_line_without_a_traceback(base, raw, caplog):
    """aiohttp logged these at ERROR with a traceback (seen when a gRPC client reached a
    gateway's port during the schemathesis run); the client's fault is one INFO line now."""
    host, port = base.removeprefix("http://").split(":")
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        answer = await reader.read()
        writer.close()
    assert answer.split(b" ", 2)[1] == b"400"
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.INFO and not r.exc_info for r in records)
    assert "BadHttpMessage 400" in records[0].getMessage()


async def test_a_failure_after_the_response_started_closes_the_connection(base):
    async with aiohttp.ClientSession() as http, http.get(base + "/bug-after-start") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


@pytest.mark.parametrize(
    ("data", "status", "body"),
    [
        (b'{"a": [1, 2.5]}', 200, {"a": [1, 2.5]}),
        (b"  ", 400, {"error": "send something", "param": "body"}),
        (
            b"{",
            400,
            {
                "error": "The request body is not valid JSON: Expecting property name enclosed in double quotes: "
                "line 1 column 2 (char 1).",
                "param": "body",
            },
        ),
        (
            b'{"a": NaN}',
            400,
            {"error": "The request body is not valid JSON: NaN is not a valid JSON value.", "param": "body"},
        ),
        (b"\xff", 400, {"error": "The request body is not valid UTF-8.", "param": "body"}),
    ],
)
async def test_read_json(base, data, status, body):
    assert await _call("POST", base + "/echo", data) == (status, body)


@pytest.mark.parametrize(
    ("data", "status", "body"),
    [
        (b'{"a": [1]}', 200, {"a": [1]}),
        (
            b'{"a": NaN}',
            400,
            {"error": "The request body is not valid JSON: NaN is not a valid JSON value.", "param": "body"},
        ),
    ],
)
async def test_read_json_of_a_large_body_answers_the_same_from_its_thread(base, monkeypatch, data, status, body):
    """Bodies past OFF_LOOP_JSON_BYTES are parsed on a thread; results and errors are the same."""
    monkeypatch.setattr(app_module, "OFF_LOOP_JSON_BYTES", 0)
    assert await _call("POST", base + "/echo", data) == (status, body)
