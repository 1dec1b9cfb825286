"""LoRA adapters through the gateways, on loopback against a mock-engine core that serves two
adapters (each answers a prompt its own way): the official `openai` SDK choosing adapters by
model name, /v1/models listing them, vLLM's load and unload routes; LMI's `adapters` field and
DJL's adapter management routes; Triton's `lora_name` and adapter-addressed URLs; WebSocket's
`model`; and every refusal in its schema's shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect

from tests.lora_helpers import make_adapter

PROMPT = "Tell me about gardens."
GEN = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-adapters")
    return {name: make_adapter(root / name, tiny_model_dir, seed=i) for i, name in enumerate(("a", "b", "c"))}


@pytest_asyncio.fixture(scope="module")
async def lora_core(start_mock_core, adapter_dirs):
    modules = (("a", str(adapter_dirs["a"])), ("b", str(adapter_dirs["b"])))
    return await start_mock_core(lora_modules=modules, enable_lora_management=True)


@pytest_asyncio.fixture(scope="module")
async def locked_core(start_mock_core, adapter_dirs):
    """A core serving adapter a without --enable-lora-management."""
    return await start_mock_core(lora_modules=(("a", str(adapter_dirs["a"])),))


@pytest_asyncio.fixture(scope="module")
async def urls(start_gateway, lora_core, locked_core):
    names = ("openai", "lmi", "triton", "ws")
    out = {name: await start_gateway(name, core=lora_core.address) for name in names}
    out["openai-locked"] = await start_gateway("openai", core=locked_core.address)
    out["lmi-locked"] = await start_gateway("lmi", core=locked_core.address)
    return out


@pytest_asyncio.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture
async def client(urls):
    c = openai.AsyncOpenAI(base_url=f"{urls['openai']}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def complete(client, model: str) -> str:
    out = await client.completions.create(model=model, prompt=PROMPT, **GEN)
    assert out.model == model
    return out.choices[0].text


async def test_openai_sdk_chooses_adapters_by_model(client):
    base, a, b = [await complete(client, m) for m in ("mock", "a", "b")]
    assert len({base, a, b}) == 3
    assert await complete(client, "a") == a
    chat = await client.chat.completions.create(model="b", messages=[{"role": "user", "content": PROMPT}], **GEN)
    assert chat.model == "b" and chat.choices[0].message.content
    plain = await client.chat.completions.create(model="mock", messages=[{"role": "user", "content": PROMPT}], **GEN)
    assert plain.choices[0].message.content != chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as info:
        await complete(client, "nope")
    assert "'nope'" in info.value.message


async def test_openai_models_list_adapters(client, adapter_dirs):
    models = {m.id: m for m in (await client.models.list()).data}
    assert sorted(models) == ["a", "b", "mock"]
    assert models["a"].parent == "mock" and models["a"].root == str(adapter_dirs["a"])
    card = await client.models.retrieve("b")
    assert card.id == "b" and card.parent == "mock"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


async def test_openai_load_and_unload_round_trip(client, urls, http, adapter_dirs):
    base = urls["openai"]
    body = {"lora_name": "c", "lora_path": str(adapter_dirs["c"])}
    async with http.post(f"{base}/v1/load_lora_adapter", json=body) as r:
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'c' added successfully."
    assert "c" in [m.id for m in (await client.models.list()).data]
    assert await complete(client, "c") not in (await complete(client, "mock"), await complete(client, "a"))
    async with http.post(f"{base}/v1/load_lora_adapter", json=body) as r:
        assert r.status == 409 and (await r.json())["error"]["message"]
    async with http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "c"}) as r:
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        await complete(client, "c")
    async with http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "c"}) as r:
        assert r.status == 404 and "'c'" in (await r.json())["error"]["message"]


async def test_openai_adapter_route_refusals(urls, http, adapter_dirs, tmp_path):
    base = urls["openai"]
    cases = [
        ("load", {"lora_name": "d"}, 400, "lora_path"),
        ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
        ("load", {"lora_name": "d", "lora_path": "/x", "extra": 1}, 400, "extra"),
        ("load", {"lora_name": "d", "lora_path": str(tmp_path / "none")}, 404, "path"),
        ("load", {"lora_name": "bad name", "lora_path": str(adapter_dirs["c"])}, 400, "name"),
        ("unload", {"lora_int_id": 3}, 400, "lora_name"),
    ]
    for route, body, status, param in cases:
        async with http.post(f"{base}/v1/{route}_lora_adapter", json=body) as r:
            error = (await r.json())["error"]
            assert r.status == status and error["param"] == param, (body, error)
    async with http.post(
        f"{base}/v1/load_lora_adapter", data=b"[1]", headers={"content-type": "application/json"}
    ) as r:
        assert r.status == 400
    body = {"lora_name": "c", "lora_path": str(adapter_dirs["c"])}
    async with http.post(f"{urls['openai-locked']}/v1/load_lora_adapter", json=body) as r:
        error = (await r.json())["error"]
        assert r.status == 400 and "--enable-lora-management" in error["message"]


async def test_lmi_adapters_field(urls, http):
    base = urls["lmi"]

    async def generated(**fields) -> tuple[int, dict]:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "do_sample": False}, **fields}
        async with http.post(f"{base}/invocations", json=body) as r:
            return r.status, await r.json()

    texts = {}
    for name in (None, "a", "b", ["a"]):
        status, body = await generated(**({} if name is None else {"adapters": name}))
        assert status == 200, body
        texts[json.dumps(name)] = body["generated_text"]
    assert len({texts["null"], texts['"a"'], texts['"b"']}) == 3 and texts['["a"]'] == texts['"a"']
    async with http.post(
        f"{base}/generate",
        json={"inputs": PROMPT, "parameters": {"adapter_id": "a", "max_new_tokens": 8, "do_sample": False}},
    ) as r:
        assert r.status == 200 and (await r.json())["generated_text"] == texts['"a"']  # TGI's field
    status, body = await generated(adapters="nope")
    assert status == 404 and "'nope'" in body["error"] and body["generated_text"] == ""
    status, body = await generated(adapters=["a", "b"])
    assert status == 424 and "adapters" in body["error"]
    status, body = await generated(adapters=3)
    assert status == 424 and "adapters" in body["error"]


async def test_lmi_dynamic_batch_adapters_per_input(start_gateway, lora_core, urls, http):
    dynamic = await start_gateway("lmi", core=lora_core.address, batching="dynamic")
    params = {"max_new_tokens": 8, "do_sample": False}
    body = {"inputs": [PROMPT, PROMPT], "parameters": params, "adapters": ["a", "b"], "stream": False}
    async with http.post(f"{dynamic}/invocations", json=body) as r:
        assert r.status == 200
        texts = [out["generated_text"] for out in await r.json()]
    async with http.post(
        f"{urls['lmi']}/invocations", json={"inputs": PROMPT, "parameters": params, "adapters": "b"}
    ) as r:
        assert texts[1] == (await r.json())["generated_text"] != texts[0]
    async with http.post(f"{dynamic}/invocations", json={**body, "adapters": ["a"]}) as r:
        assert r.status == 424 and "adapters" in (await r.json())["error"]


async def test_lmi_adapter_management_round_trip(urls, http, adapter_dirs):
    base = f"{urls['lmi']}/models/mock/adapters"
    async with http.get(base) as r:
        assert r.status == 200
        assert await r.json() == {
            "adapters": [{"name": "a", "src": str(adapter_dirs["a"])}, {"name": "b", "src": str(adapter_dirs["b"])}]
        }
    async with http.get(base, params={"limit": "1"}) as r:
        page = await r.json()
        assert page["adapters"][0]["name"] == "a" and page["nextPageToken"] == "1"
    async with http.get(base, params={"limit": "1", "next_page_token": "1"}) as r:
        assert (await r.json()) == {"adapters": [{"name": "b", "src": str(adapter_dirs["b"])}]}
    async with http.post(base, params={"name": "c", "src": str(adapter_dirs["c"])}) as r:
        assert r.status == 200 and await r.json() == {"status": "Adapter c registered"}
    async with http.get(f"{base}/c") as r:
        assert await r.json() == [{"name": "c", "src": str(adapter_dirs["c"])}]
    async with http.post(f"{urls['lmi']}/invocations", json={"inputs": PROMPT, "adapters": "c"}) as r:
        assert r.status == 200
    async with http.delete(f"{base}/c") as r:
        assert r.status == 200 and await r.json() == {"status": "Adapter c unregistered"}
    async with http.delete(f"{base}/c") as r:
        body = await r.json()
        assert r.status == 404 and body["code"] == 404 and body["type"] == "ModelNotFoundException"
        assert "'c'" in body["message"]


async def test_lmi_adapter_management_refusals(urls, http, adapter_dirs):
    base = urls["lmi"]
    cases = [
        ("get", "/models/other/adapters", {}, 404),
        ("get", "/models/mock/adapters/nope", {}, 404),
        ("get", "/models/mock/adapters", {"limit": "x"}, 400),
        ("get", "/models/mock/adapters", {"limit": "0"}, 400),
        ("post", "/models/mock/adapters", {"name": "d"}, 400),
        ("post", "/models/mock/adapters", {"name": "a", "src": str(adapter_dirs["a"])}, 409),
    ]
    for method, path, params, status in cases:
        async with http.request(method, f"{base}{path}", params=params) as r:
            body = await r.json()
            assert r.status == status and body["code"] == status and body["message"], (path, params, body)
            assert set(body) == {"code", "type", "message"}
    async with http.post(
        f"{urls['lmi-locked']}/models/mock/adapters", params={"name": "c", "src": str(adapter_dirs["c"])}
    ) as r:
        body = await r.json()
        assert r.status == 400 and body["type"] == "BadRequestException"
        assert "--enable-lora-management" in body["message"]


async def test_triton_lora_name_and_adapter_urls(urls, http):
    base = urls["triton"]

    async def generate(model: str, **parameters) -> tuple[int, dict]:
        body = {"text_input": PROMPT, "parameters": {"max_tokens": 8, **parameters}}
        async with http.post(f"{base}/v2/models/{model}/generate", json=body) as r:
            return r.status, await r.json()

    _, base_out = await generate("mock")
    status, by_param = await generate("mock", lora_name="a")
    assert status == 200 and by_param["text_output"] != base_out["text_output"]
    status, by_url = await generate("a")
    assert status == 200 and by_url["text_output"] == by_param["text_output"] and by_url["model_name"] == "a"
    status, body = await generate("a", lora_name="b")
    assert status == 400 and "lora_name" in body["error"]
    status, body = await generate("mock", lora_name="nope")
    assert status == 404 and "'nope'" in body["error"]
    status, body = await generate("nope")
    assert status == 404


async def test_websocket_model_chooses_the_adapter(urls):
    url = "ws" + urls["ws"][len("http") :] + "/ws"

    async def run(rid: str, model: str | None) -> list[dict]:
        frame = {"prompts": [{"request_id": rid, "prompt": PROMPT}], "generation_config": {"max_new_tokens": 8}}
        if model is not None:
            frame["model"] = model
        events: list[dict] = []
        async with connect(url) as ws:
            await ws.send(json.dumps(frame))
            while not events or events[-1]["type"] not in ("COMPLETE", "ERROR"):
                events += json.loads(await asyncio.wait_for(ws.recv(), 60))
        return events

    base, a, same = [(await run(rid, m))[-1] for rid, m in (("r1", None), ("r2", "a"), ("r3", "a"))]
    assert base["type"] == a["type"] == "COMPLETE" and base["text"] != a["text"] and a["text"] == same["text"]
    error = (await run("r4", "nope"))[-1]
    assert error["type"] == "ERROR" and "'nope'" in error["error"]
