"""LoRA adapters over gRPC: a core on the HF engine (in its own process) serving adapters from
its model directory's adapters/ and from --lora-modules, a request's adapter giving the merged
model's greedy tokens, the adapter RPCs' round trip and every refusal, API keys on them, and the
mock engine's per-adapter outputs."""

from __future__ import annotations

import shutil

import grpc
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.server import start_core
from tests.conftest import core_config
from tests.integration.core_helpers import bad_request_field, reason_of
from tests.lora_helpers import linear_shapes, make_adapter, merged_greedy

STEPS = 6
PROMPT = [1, *range(40, 60)]


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model with adapters/fromdir/ (DJL's layout), and two more adapters
    outside it: (model dir, {name: adapter dir})."""
    root = tmp_path_factory.mktemp("lora-model")
    model = shutil.copytree(tiny_model_dir, root / "tiny")
    shapes = linear_shapes(model)
    paths = {
        "fromdir": make_adapter(model / "adapters" / "fromdir", model, shapes=shapes, seed=11),
        "flagged": make_adapter(root / "flagged", model, shapes=shapes, seed=12, targets=("gate_proj", "down_proj")),
        "later": make_adapter(root / "later", model, shapes=shapes, seed=13, rank=4),
        "wide": make_adapter(root / "wide", model, shapes=shapes, seed=14, rank=32),
    }
    return model, paths


@pytest.fixture(scope="module")
def expected(lora_model):
    model, paths = lora_model
    out = {"": merged_greedy(model, None, [PROMPT], STEPS)[0]}
    for name in ("fromdir", "flagged", "later"):
        out[name] = merged_greedy(model, paths[name], [PROMPT], STEPS)[0]
    return out


@pytest_asyncio.fixture(scope="module")
async def lora_stub(lora_model):
    model, paths = lora_model
    config = core_config(
        model, lora_modules=(("flagged", str(paths["flagged"])),), max_loras=2, enable_lora_management=True
    )
    server = await start_core(config)
    channel = grpc.aio.insecure_channel(server.address)
    yield spb_grpc.GenerateServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def greedy(stub, adapter: str = "") -> list[int]:
    ids: list[int] = []
    request = spb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        adapter=adapter,
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=STEPS, ignore_eos=True),
    )
    async for m in stub.Generate(request):
        for o in m.outputs:
            ids += [t.id for t in o.tokens]
    return ids


async def test_adapters_at_start_and_their_tokens(lora_stub, lora_model, expected):
    info = await lora_stub.GetModelInfo(spb.GetModelInfoRequest())
    assert [a.name for a in info.adapters] == ["flagged", "fromdir"] and info.max_loras == 2
    assert {a.name: a.rank for a in info.adapters} == {"flagged": 8, "fromdir": 8}
    for name in ("", "fromdir", "flagged"):
        assert await greedy(lora_stub, name) == expected[name], name
    listed = await lora_stub.ListAdapters(spb.ListAdaptersRequest())
    assert listed.max_loras == 2 and [a.name for a in listed.adapters] == ["flagged", "fromdir"]
    assert all(a.running == 0 and a.waiting == 0 for a in listed.adapters)


async def test_unknown_adapter_is_not_found(lora_stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await greedy(lora_stub, "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in info.value.details() and bad_request_field(info.value) == "adapter"
    assert reason_of(info.value) == "ADAPTER_NOT_FOUND"


async def test_load_and_unload_round_trip(lora_stub, lora_model, expected):
    _, paths = lora_model
    loaded = await lora_stub.LoadAdapter(spb.LoadAdapterRequest(name="later", path=str(paths["later"])))
    assert loaded.adapter.name == "later" and loaded.adapter.rank == 4 and loaded.adapter.path == str(paths["later"])
    assert await greedy(lora_stub, "later") == expected["later"]
    listed = await lora_stub.ListAdapters(spb.ListAdaptersRequest())
    assert "later" in [a.name for a in listed.adapters]
    assert sum(a.resident for a in listed.adapters) <= 2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lora_stub.LoadAdapter(spb.LoadAdapterRequest(name="later", path=str(paths["later"])))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await lora_stub.UnloadAdapter(spb.UnloadAdapterRequest(name="later"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await greedy(lora_stub, "later")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lora_stub.UnloadAdapter(spb.UnloadAdapterRequest(name="later"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'later'" in info.value.details()
    assert await greedy(lora_stub, "fromdir") == expected["fromdir"]  # the others are untouched


async def test_load_refusals(lora_stub, lora_model, tmp_path):
    model, paths = lora_model
    cases = [
        (spb.LoadAdapterRequest(name="wide", path=str(paths["wide"])), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (spb.LoadAdapterRequest(name="gone", path=str(tmp_path / "none")), grpc.StatusCode.NOT_FOUND, "path"),
        (spb.LoadAdapterRequest(name="nopath", path=""), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (spb.LoadAdapterRequest(name="bad name", path=str(paths["later"])), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (spb.LoadAdapterRequest(name="tiny", path=str(paths["later"])), grpc.StatusCode.INVALID_ARGUMENT, "name"),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await lora_stub.LoadAdapter(request)
        assert info.value.code() == code, request
        assert bad_request_field(info.value) == field, request
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lora_stub.LoadAdapter(spb.LoadAdapterRequest(name="wide", path=str(paths["wide"])))
    assert reason_of(info.value) == "LORA_RANK_TOO_LARGE" and "--max-lora-rank 16" in info.value.details()
    misfit = make_adapter(tmp_path / "misfit", model, shapes={"model.layers.0.self_attn.q_proj": (64, 128)})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lora_stub.LoadAdapter(spb.LoadAdapterRequest(name="misfit", path=str(misfit)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(info.value) == "LORA_BASE_MODEL_MISMATCH"
    other = make_adapter(tmp_path / "other", model, config={"base_model_name_or_path": "meta-llama/Llama-3-8B"})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await lora_stub.LoadAdapter(spb.LoadAdapterRequest(name="other", path=str(other)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Llama-3-8B" in info.value.details()
    listed = await lora_stub.ListAdapters(spb.ListAdaptersRequest())
    assert [a.name for a in listed.adapters] == ["flagged", "fromdir"]


async def test_management_is_off_by_default_and_behind_the_api_key(start_mock_core, lora_model):
    _, paths = lora_model
    core = await start_mock_core()
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        for call in (
            stub.LoadAdapter(spb.LoadAdapterRequest(name="x", path=str(paths["later"]))),
            stub.UnloadAdapter(spb.UnloadAdapterRequest(name="x")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-lora-management" in info.value.details()
            assert reason_of(info.value) == "LORA_MANAGEMENT_DISABLED"
    keyed = await start_mock_core(api_key=("k1",), enable_lora_management=True)
    async with grpc.aio.insecure_channel(keyed.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        for call in (
            stub.ListAdapters(spb.ListAdaptersRequest()),
            stub.LoadAdapter(spb.LoadAdapterRequest(name="x", path=str(paths["later"]))),
            stub.UnloadAdapter(spb.UnloadAdapterRequest(name="x")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = (("authorization", "Bearer k1"),)
        await stub.LoadAdapter(spb.LoadAdapterRequest(name="x", path=str(paths["later"])), metadata=key)
        listed = await stub.ListAdapters(spb.ListAdaptersRequest(), metadata=key)
        assert [a.name for a in listed.adapters] == ["x"]


async def test_the_mock_engine_answers_each_adapter_its_own_way(start_mock_core, lora_model):
    _, paths = lora_model
    core = await start_mock_core(lora_modules=(("a", str(paths["later"])), ("b", str(paths["flagged"]))))
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        runs = {name: await greedy(stub, name) for name in ("", "a", "b", "a")}
        assert len({tuple(v) for v in runs.values()}) == 3
        assert runs["a"] == await greedy(stub, "a")  # deterministic
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await greedy(stub, "c")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_lora_metrics(start_mock_core, lora_model):
    """vLLM's vllm:lora_requests_info names the adapters running, and per-adapter counters
    count ended requests."""
    import aiohttp

    _, paths = lora_model
    core = await start_mock_core(lora_modules=(("a", str(paths["later"])),), metrics_port=0, mock_step_ms=20.0)
    url = f"http://127.0.0.1:{core.metrics.port}/metrics"
    async with grpc.aio.insecure_channel(core.address) as channel, aiohttp.ClientSession() as http:
        stub = spb_grpc.GenerateServiceStub(channel)
        await greedy(stub, "a")
        long = spb.GenerateRequest(text="hi", adapter="a", stopping=pb.StoppingParams(max_new_tokens=1000))
        call = stub.Generate(long)
        async for m in call:
            if m.outputs:
                break
        async with http.get(url) as r:
            text = await r.text()
        call.cancel()
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1
    assert 'running_lora_adapters="a"' in info[0] and 'max_lora="4"' in info[0]
    assert 'waiting_lora_adapters=""' in info[0] and float(info[0].rsplit(" ", 1)[1]) > 1e9
    assert 'trellis_core_lora_requests_total{adapter="a",model_name="mock"} 1.0' in text
    assert f'trellis_core_lora_generation_tokens_total{{adapter="a",model_name="mock"}} {float(STEPS)}' in text


async def test_start_up_adapters_that_cannot_be_served_stop_the_core(start_mock_core, lora_model, tmp_path):
    _, paths = lora_model
    with pytest.raises(RuntimeError, match="engine serves none"):
        await start_mock_core(lora_modules=(("a", str(paths["later"])),), max_loras=0)
    with pytest.raises(RuntimeError, match="cannot serve adapter gone from"):
        await start_mock_core(lora_modules=(("gone", str(tmp_path / "none")),))
