"""API keys, every path good and bad: the core's interceptor (UNAUTHENTICATED, health open), each
gateway's 401 in its schema's own shape with `WWW-Authenticate: Bearer`, the WebSocket upgrade
refused, health and metrics open (metrics behind the key with --metrics-require-key), the
gateway's own key to the core, and the flags and environment variables."""

from __future__ import annotations

import aiohttp
import grpc
import openai
import pytest
import websockets
from grpc_health.v1 import health_pb2, health_pb2_grpc
from multidict import CIMultiDict
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.config import load as load_core
from envflags.apikeys import ApiKeys
from gateways.common.config import load as load_gateway
from tests.integration.core_helpers import request

CORE_KEYS = ("core-key-1", "core-key-2")
GATEWAY_KEY = "gateway-key"
BODY = {"text": "Once upon a time", "stopping": {"maxNewTokens": 3}}


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
async def keyed_core(start_mock_core):
    return await start_mock_core(api_key=CORE_KEYS)


@pytest.fixture(scope="module")
async def stub(keyed_core):
    async with grpc.aio.insecure_channel(keyed_core.address) as channel:
        yield channel, spb_grpc.GenerateServiceStub(channel)


# --------------------------------------------------------------------------- the core


@pytest.mark.parametrize(
    "metadata, message",
    [((), "Missing API key"), (bearer("nope"), "Invalid API key"), ((("authorization", "Basic abc"),), "Missing")],
)
async def test_core_refuses_calls_without_an_accepted_key(stub, metadata, message):
    _, s = stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [m async for m in s.Generate(request(BODY), metadata=metadata)]
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED and message in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.GetModelInfo(spb.GetModelInfoRequest(), metadata=metadata)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    call = s.MultiplexGenerate(metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("second", [CORE_KEYS[0], "nope"])
async def test_core_refuses_a_call_with_two_authorization_entries(stub, second):
    """Two `authorization` entries are refused whatever they hold (one rule with the gateways'
    repeated headers), even when both carry accepted keys."""
    _, s = stub
    metadata = (*bearer(CORE_KEYS[1]), *bearer(second))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.GetModelInfo(spb.GetModelInfoRequest(), metadata=metadata)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than one authorization value" in info.value.details()


async def test_core_serves_every_accepted_key_and_health_stays_open(stub):
    channel, s = stub
    for key in CORE_KEYS:
        msgs = [m async for m in s.Generate(request(BODY), metadata=bearer(key))]
        assert msgs[-1].usage.completion_tokens == 3
    lower = [m async for m in s.Generate(request(BODY), metadata=(("authorization", f"bearer {CORE_KEYS[0]}"),))]
    assert lower[-1].usage.completion_tokens == 3
    health = health_pb2_grpc.HealthStub(channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_keys_are_compared_as_digests():
    keys = ApiKeys(["a", "b"])
    assert keys.check("Bearer a") is None and keys.check("Bearer  b ") is None
    assert keys.check("Bearer c") == "wrong"
    assert keys.check(None) == keys.check("") == keys.check("Bearer ") == keys.check("Token a") == "missing"


def test_core_keys_from_flags_and_environment():
    assert load_core(["--model", "m"], {}).api_key == ()
    env = {"TRELLIS_CORE_API_KEY": "x, y"}
    assert load_core(["--model", "m"], env).api_key == ("x", "y")
    config = load_core(["--model", "m", "--api-key", "key-z", "--api-key", "key-w"], env)
    assert config.api_key == ("key-z", "key-w")
    assert "key-z" not in str(config.redacted()) and config.redacted()["api_key"] == "<2 keys>"


def test_gateway_keys_from_flags_and_environment():
    config = load_gateway("openai", 8000, lambda p: None, [], {"TRELLIS_GATEWAY_API_KEY": "a,b"})
    assert config.api_key == ("a", "b") and config.core_api_key == "" and not config.metrics_require_key
    config = load_gateway(
        "openai", 8000, lambda p: None, ["--api-key", "c", "--metrics-require-key"], {"TRELLIS_CORE_API_KEY": "k1,k2"}
    )
    assert config.api_key == ("c",) and config.core_api_key == "k1" and config.metrics_require_key
    config = load_gateway("openai", 8000, lambda p: None, ["--core-api-key", "mine"], {"TRELLIS_CORE_API_KEY": "k1"})
    assert config.core_api_key == "mine"
    assert "mine" not in str(config.redacted())


# --------------------------------------------------------------------------- the gateways


@pytest.fixture(scope="module")
async def openai_url(start_gateway, keyed_core):
    return await start_gateway("openai", core=keyed_core.address, api_key=(GATEWAY_KEY,), core_api_key=CORE_KEYS[1])


async def test_openai_gateway_serves_the_right_key(openai_url):
    client = openai.AsyncOpenAI(base_url=f"{openai_url}/v1", api_key=GATEWAY_KEY, max_retries=0)
    resp = await client.completions.create(model="mock", prompt="hi", max_tokens=3)
    assert resp.usage.completion_tokens == 3
    chat = await client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage.completion_tokens == 2
    await client.close()


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {GATEWAY_KEY}"), ("Authorization", "Bearer other")],
        [("Authorization", "Bearer other"), ("Authorization", f"Bearer {GATEWAY_KEY}")],
        [("x-api-key", GATEWAY_KEY), ("x-api-key", GATEWAY_KEY)],
    ],
)
async def test_gateway_refuses_two_credentials_with_400(openai_url, headers):
    """Which of two Authorization headers wins differs between proxies and frameworks, so the
    gateway serves neither: 400 in the schema's shape, whatever the order."""
    async with aiohttp.ClientSession() as s:
        hdrs = CIMultiDict(headers)
        async with s.post(f"{openai_url}/v1/chat/completions", json={}, headers=hdrs) as r:
            assert r.status == 400
            assert "more than one authorization value" in (await r.json())["error"]["message"]


async def test_an_authorization_header_wins_over_x_api_key(openai_url):
    async with aiohttp.ClientSession() as s:
        hdrs = {"Authorization": "Bearer wrong", "x-api-key": GATEWAY_KEY}
        async with s.get(f"{openai_url}/v1/models", headers=hdrs) as r:
            assert r.status == 401


async def test_openai_gateway_answers_401_with_openais_error_object(openai_url):
    client = openai.AsyncOpenAI(base_url=f"{openai_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await client.models.list()
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    assert info.value.body["message"] == "Invalid API key."
    await client.close()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{openai_url}/v1/chat/completions", json={}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert (await r.json())["error"]["message"].startswith("Missing API key")
        async with s.get(f"{openai_url}/health") as r:
            assert r.status == 200
        async with s.get(f"{openai_url}/metrics") as r:
            assert r.status == 200
            assert 'trellis_gateway_requests_total{method="POST",route="/v1/chat/completions",status="401"}' in (
                await r.text()
            )


async def test_metrics_behind_the_key_when_asked(start_gateway, keyed_core):
    url = await start_gateway("openai", core=keyed_core.address, api_key=(GATEWAY_KEY,), metrics_require_key=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/metrics") as r:
            assert r.status == 401
        async with s.get(f"{url}/metrics", headers={"Authorization": f"Bearer {GATEWAY_KEY}"}) as r:
            assert r.status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 200  # open, and the core's health needs no key either


async def test_gateway_without_the_cores_key_gets_a_500_not_the_clients_401(start_gateway, keyed_core):
    url = await start_gateway("openai", core=keyed_core.address)
    body = {"model": "mock", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 500
        assert "--core-api-key" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(
    "name, method, path, shape",
    [
        ("lmi", "POST", "/invocations", lambda b: b == {"error": "Invalid API key.", "code": 401}),
        ("triton", "POST", "/v2/models/mock/generate", lambda b: b == {"error": "Invalid API key."}),
        ("ws", "GET", "/ws", lambda b: b == [{"error": "Invalid API key."}]),
    ],
)
async def test_every_gateway_answers_401_in_its_own_shape(start_gateway, keyed_core, name, method, path, shape):
    url = await start_gateway(name, core=keyed_core.address, api_key=(GATEWAY_KEY,), core_api_key=CORE_KEYS[0])
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json={}, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert shape(await r.json())
        health = {"lmi": "/ping", "triton": "/v2/health/ready", "ws": "/metrics"}[name]
        async with s.get(url + health) as r:
            assert r.status == 200


async def test_websocket_upgrade_is_refused_without_the_key_and_served_with_it(start_gateway, keyed_core):
    url = await start_gateway("ws", core=keyed_core.address, api_key=(GATEWAY_KEY,), core_api_key=CORE_KEYS[0])
    ws_url = url.replace("http://", "ws://") + "/ws"
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(ws_url):
            pass
    assert info.value.response.status_code == 401
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    async with websockets.connect(ws_url, additional_headers=headers) as ws:
        await ws.send('[{"request_id": "a", "prompt": "hi", "generation_config": {"max_new_tokens": 2}}]')
        assert await ws.recv()


async def test_core_metrics_behind_the_key_when_asked(start_mock_core):
    core = await start_mock_core(api_key=CORE_KEYS, metrics_port=0, metrics_require_key=True)
    url = f"http://127.0.0.1:{core.metrics.port}/metrics"
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        async with s.get(url, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.get(url, headers={"Authorization": f"Bearer {CORE_KEYS[1]}"}) as r:
            assert r.status == 200 and "vllm:num_requests_waiting" in await r.text()
    await core.stop(0)


async def test_metrics_require_key_without_keys_is_refused(start_mock_core, start_gateway):
    with pytest.raises(ValueError, match="needs --api-key"):
        await start_mock_core(metrics_port=0, metrics_require_key=True)
    with pytest.raises(ValueError, match="needs --api-key"):
        await start_gateway("openai", metrics_require_key=True)
