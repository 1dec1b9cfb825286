"""Continue-generation sessions belong to their caller: the core keys them by the identity of
the call's API key and by the tenant a gateway names (its client's key), so another key's
client that sends the same id neither reads nor extends the session. Session ids are bounded
in length, and the store counts bytes. Real WebSocket clients through a real gateway, and real
gRPC clients, against mock-engine cores on loopback."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from core.sessions import ENTRY_OVERHEAD, SessionStore
from core.validation import MAX_SESSION_ID_CHARS, MAX_TENANT_CHARS
from gateways.common.status import GatewayError
from tests.integration.test_gateway_ws import batch, greedy, run, ws_url

pytestmark = pytest.mark.timeout(120)

SECRET = "the secret prompt of tenant A"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def gateway(mock_core, start_gateway):
    return await start_gateway("ws", core=mock_core.address, env_file="", api_key=("key-a", "key-b"))


async def test_another_keys_client_gets_nothing_of_a_session(gateway):
    async with (
        connect(ws_url(gateway), additional_headers=_bearer("key-a")) as a,
        connect(ws_url(gateway), additional_headers=_bearer("key-b")) as b,
    ):
        first = await run(a, batch(("victim", SECRET), **greedy(4)))
        assert first["victim"][-1]["type"] == "COMPLETE"
        stolen = await run(b, batch(("victim", ""), only_new_tokens=False, **greedy(4)))
        # B's own request: no session of its own under that id, and an empty prompt.
        assert [e["type"] for e in stolen["victim"]] == ["ERROR"]
        assert SECRET not in str(stolen)
        # B's prompt under the same id is a session of B's, not an extension of A's.
        await run(b, batch(("victim", "tenant B writes here"), **greedy(4)))
        again = await run(a, batch(("victim", ""), only_new_tokens=False, **greedy(4)))
    whole = again["victim"][-1]
    assert whole["type"] == "COMPLETE"
    assert whole["text"].startswith(SECRET + first["victim"][-1]["text"])
    assert "tenant B" not in whole["text"]


async def test_a_session_id_too_long_is_refused_in_the_websocket_shape(gateway):
    long_id = "x" * (MAX_SESSION_ID_CHARS + 1)
    async with connect(ws_url(gateway), additional_headers=_bearer("key-a")) as ws:
        events = await run(ws, batch((long_id, "hi"), **greedy(2)))
    (event,) = events[long_id]
    assert event["type"] == "ERROR"
    assert f"longer than {MAX_SESSION_ID_CHARS} characters" in event["error"]


@pytest.fixture(scope="module")
async def keyed_core(start_mock_core):
    return await start_mock_core(api_key=("grpc-a", "grpc-b"))


def _session_request(session_id: str, text: str | None) -> spb.GenerateRequest:
    req = spb.GenerateRequest(
        session_id=session_id,
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=3),
        output=pb.OutputOptions(echo=True),
    )
    if text is not None:
        req.text = text
    return req


async def test_grpc_callers_with_other_keys_have_separate_sessions(keyed_core):
    async with grpc.aio.insecure_channel(keyed_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        a, b = (("authorization", "Bearer grpc-a"),), (("authorization", "Bearer grpc-b"),)
        _ = [m async for m in stub.Generate(_session_request("shared", SECRET), metadata=a)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in stub.Generate(_session_request("shared", None), metadata=b)]
        assert GatewayError.from_rpc_error(e.value).param == "text"  # no live session of B's
        again = [m async for m in stub.Generate(_session_request("shared", None), metadata=a)]
    assert again[0].session_continued
    assert again[0].prompt_text.startswith(SECRET)


async def test_a_session_id_too_long_is_invalid_argument(mock_core):
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in stub.Generate(_session_request("s" * (MAX_SESSION_ID_CHARS + 1), "hi"))]
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert GatewayError.from_rpc_error(e.value).param == "session_id"


async def test_a_tenant_too_long_is_invalid_argument(mock_core):
    request = _session_request("s", "hi")
    request.tenant = "t" * (MAX_TENANT_CHARS + 1)
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in stub.Generate(request)]
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert GatewayError.from_rpc_error(e.value).param == "tenant"


def test_the_store_counts_the_bytes_of_its_keys():
    """Sessions of few tokens under long ids fill the byte budget, not the token budget."""
    store = SessionStore(max_tokens=1_000_000, ttl_seconds=3600, max_bytes=10 * (ENTRY_OVERHEAD + 256 + 12))
    for i in range(20):
        key = f"{i:03d}" + "k" * 253
        store.acquire(key)
        store.release(key, [1, 2, 3])
    assert store.total_bytes <= store.max_bytes
    assert len(store) == 10
    assert store.total_tokens == 30
    huge = "k" * store.max_bytes  # larger than the whole budget: not stored, nothing evicted
    store.acquire(huge)
    store.release(huge, [1])
    assert store.get(huge) is None
    assert len(store) == 10
