"""LoRA adapter management through a gateway with several cores (gateways.common.adapter_admin):
a load or unload reaches every core, a load that any reachable core refuses is undone on the
others, an unreachable core is left out, and listings are the union of the cores'. Through
vLLM's routes on the OpenAI gateway, DJL's on the LMI gateway, and the gateway's gRPC client
(CoreClient) itself; each core's own state is read over gRPC.

The cores run the mock engine (the engine does not matter to management).
"""

from __future__ import annotations

import socket

import aiohttp
import grpc
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from gateways.common.core_client import CoreClient
from gateways.common.status import GatewayError
from tests.lora_helpers import make_adapter


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-admin-adapters")
    return {name: str(make_adapter(root / name, tiny_model_dir, seed=i)) for i, name in enumerate(("x", "y", "z"))}


@pytest_asyncio.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def cores_with(start_mock_core, *management: bool, **overrides):
    return [await start_mock_core(enable_lora_management=m, **overrides) for m in management]


async def on_core(core, name: str, *, path: str | None = None) -> None:
    """Load (with a path) or unload an adapter on one core directly, over gRPC."""
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        if path is None:
            await stub.UnloadAdapter(spb.UnloadAdapterRequest(name=name))
        else:
            await stub.LoadAdapter(spb.LoadAdapterRequest(name=name, path=path))


async def held(core) -> dict[str, str]:
    """The adapters a core registered (name -> path), read over gRPC."""
    async with grpc.aio.insecure_channel(core.address) as channel:
        reply = await spb_grpc.GenerateServiceStub(channel).ListAdapters(spb.ListAdaptersRequest())
    return {a.name: a.path for a in reply.adapters}


def dead_address() -> str:
    """A loopback address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("routing", ["prefix", "round_robin"])
async def test_openai_load_and_unload_reach_every_core(start_mock_core, start_gateway, http, adapter_dirs, routing):
    cores = await cores_with(start_mock_core, True, True, True)
    url = await start_gateway("openai", core=",".join(c.address for c in cores), routing=routing)
    body = {"lora_name": "x", "lora_path": adapter_dirs["x"]}
    async with http.post(f"{url}/v1/load_lora_adapter", json=body) as r:
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'x' added successfully."
    assert [await held(c) for c in cores] == [{"x": adapter_dirs["x"]}] * 3
    async with http.get(f"{url}/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["mock", "x"]  # listed once
    for i in range(6):  # wherever routing sends them, the adapter is there
        request = {"model": "x", "prompt": f"Question {i}?", "max_tokens": 2}
        async with http.post(f"{url}/v1/completions", json=request) as r:
            assert r.status == 200, await r.text()
    async with http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}) as r:
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'x' removed successfully."
    assert [await held(c) for c in cores] == [{}] * 3
    async with http.post(f"{url}/v1/completions", json={"model": "x", "prompt": "Hi", "max_tokens": 2}) as r:
        assert r.status == 404
    async with http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}) as r:
        error = (await r.json())["error"]
        assert r.status == 404 and error["message"].startswith("The adapter 'x' is not loaded")  # as one core says


async def test_a_refused_load_is_undone_on_the_cores_that_loaded_it(start_mock_core, start_gateway, http, adapter_dirs):
    cores = await cores_with(start_mock_core, True, False, True)  # the second: management off
    url = await start_gateway("openai", core=",".join(c.address for c in cores))
    async with http.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapter_dirs["x"]}) as r:
        error = (await r.json())["error"]
    assert r.status == 400
    message = error["message"]
    assert message.startswith("The adapter 'x' was not loaded on every core: ")
    assert f"{cores[1].address} refused it (FAILED_PRECONDITION: " in message and "--enable-lora-management" in message
    assert message.endswith(f"It was unloaded again from {cores[0].address}, {cores[2].address}, which had loaded it.")
    assert [await held(c) for c in cores] == [{}] * 3
    # DJL's route: the same refusal in DJL's error shape.
    lmi = await start_gateway("lmi", core=",".join(c.address for c in cores))
    async with http.post(f"{lmi}/models/mock/adapters", params={"name": "x", "src": adapter_dirs["x"]}) as r:
        body = await r.json()
    assert r.status == 400 and body["type"] == "BadRequestException" and body["code"] == 400
    assert body["message"].startswith("The adapter 'x' was not loaded on every core")
    assert [await held(c) for c in cores] == [{}] * 3


async def test_a_name_taken_for_another_path_is_a_conflict(start_mock_core, start_gateway, http, adapter_dirs):
    cores = await cores_with(start_mock_core, True, True, True)
    await on_core(cores[1], "x", path=adapter_dirs["y"])  # another adapter under the name
    lmi = await start_gateway("lmi", core=",".join(c.address for c in cores))
    async with http.post(f"{lmi}/models/mock/adapters", params={"name": "x", "src": adapter_dirs["x"]}) as r:
        body = await r.json()
    assert r.status == 409 and body["type"] == "ConflictException"
    assert f"{cores[1].address} refused it (ALREADY_EXISTS: " in body["message"]
    assert [await held(c) for c in cores] == [{}, {"x": adapter_dirs["y"]}, {}]  # as before the call


async def test_loading_again_repairs_a_core_without_it(start_mock_core, start_gateway, http, adapter_dirs):
    cores = await cores_with(start_mock_core, True, True, True)
    await on_core(cores[0], "x", path=adapter_dirs["x"])  # the others lost it (restarted)
    url = await start_gateway("openai", core=",".join(c.address for c in cores))
    body = {"lora_name": "x", "lora_path": adapter_dirs["x"]}
    async with http.post(f"{url}/v1/load_lora_adapter", json=body) as r:
        assert r.status == 200, await r.text()
    assert [await held(c) for c in cores] == [{"x": adapter_dirs["x"]}] * 3
    async with http.post(f"{url}/v1/load_lora_adapter", json=body) as r:  # every core has it: as one core says
        error = (await r.json())["error"]
    assert r.status == 409 and error["message"] == "An adapter named 'x' is loaded already; unload it first."


async def test_an_unreachable_core_is_left_out(start_mock_core, start_gateway, http, adapter_dirs):
    cores = await cores_with(start_mock_core, True, True)
    dead = dead_address()
    lmi = await start_gateway("lmi", core=",".join([cores[0].address, dead, cores[1].address]))
    base = f"{lmi}/models/mock/adapters"
    async with http.post(base, params={"name": "x", "src": adapter_dirs["x"]}) as r:
        assert r.status == 200 and await r.json() == {"status": "Adapter x registered"}
    assert [await held(c) for c in cores] == [{"x": adapter_dirs["x"]}] * 2
    async with http.get(base) as r:
        assert r.status == 200 and await r.json() == {"adapters": [{"name": "x", "src": adapter_dirs["x"]}]}
    async with http.delete(f"{base}/x") as r:
        assert r.status == 200 and await r.json() == {"status": "Adapter x unregistered"}
    assert [await held(c) for c in cores] == [{}] * 2
    nobody = await start_gateway("openai", core=",".join([dead, dead_address()]))
    async with http.post(f"{nobody}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}) as r:
        error = (await r.json())["error"]
    assert r.status == 503 and error["message"] == "The model server cannot be reached."


async def test_an_unload_refused_by_one_core_says_where_it_went(start_mock_core, start_gateway, http, adapter_dirs):
    cores = await cores_with(start_mock_core, True, False, lora_modules=(("x", adapter_dirs["x"]),))
    url = await start_gateway("openai", core=",".join(c.address for c in cores))
    async with http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}) as r:
        error = (await r.json())["error"]
    assert r.status == 400
    assert error["message"].startswith("The adapter 'x' was not unloaded from every core: ")
    assert f"{cores[1].address} refused it (FAILED_PRECONDITION: " in error["message"]
    assert error["message"].endswith(f"It was unloaded from {cores[0].address}.")
    assert [await held(c) for c in cores] == [{}, {"x": adapter_dirs["x"]}]


async def test_the_grpc_client_lists_the_union_of_the_cores(start_mock_core, adapter_dirs):
    one = await start_mock_core(lora_modules=(("x", adapter_dirs["x"]), ("y", adapter_dirs["y"])), max_loras=2)
    two = await start_mock_core(lora_modules=(("y", adapter_dirs["y"]), ("z", adapter_dirs["z"])), max_loras=3)
    client = CoreClient(f"{one.address},{two.address}")
    try:
        listing = await client.list_adapters()
        assert [(a.name, a.path) for a in listing.adapters] == [
            ("x", adapter_dirs["x"]),
            ("y", adapter_dirs["y"]),
            ("z", adapter_dirs["z"]),
        ]
        assert listing.max_loras == 3
        with pytest.raises(GatewayError) as refused:  # management is off on both: as one core says
            await client.load_adapter("w", adapter_dirs["x"])
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "was not loaded on every core" not in refused.value.message
        with pytest.raises(GatewayError) as locked:
            await client.unload_adapter("x")
        assert locked.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "was not unloaded from every core" not in locked.value.message
    finally:
        await client.close()


async def test_a_dns_name_that_does_not_resolve_leaves_management_on_the_balanced_channel(caplog):
    client = CoreClient("dns:///no-such-core.invalid:1")
    with caplog.at_level("WARNING"):
        targets = await client._management_targets()
    assert targets == [(client.address, client.stub)]
    assert "looking up no-such-core.invalid for adapter management failed" in caplog.text
    await client.close()
