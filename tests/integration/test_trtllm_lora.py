"""LoRA adapters on `--engine trtllm` against the executor double, through the real core and
gRPC on loopback: an adapter chosen by name reaches the executor as a LoraConfig with its task
id, its weights go once, a PEFT cache miss is answered by sending them again, and every
refusal, in each binding era; and the LLM API's LoRARequest per request."""

from __future__ import annotations

import shutil

import grpc
import pytest
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.engine.trtllm import llm as trtllm_llm
from core.engine.trtllm.lora import MODULE_IDS
from tests.fakes import trtllm_executor
from tests.fakes import trtllm_llm as fake_llm
from tests.fakes.trtllm_harness import collect, make_engine_output, serve_engine, tokens_of
from tests.integration.core_helpers import reason_of
from tests.integration.core_helpers import request_of as request
from tests.lora_helpers import linear_shapes, make_adapter

ERAS = ["0.11", "0.15", "1.0", "1.3"]
HIDDEN, LAYERS = 64, 2
BUILT = ("attn_q", "attn_v")
SHAPES = {
    f"model.layers.{i}.{part}": shape
    for i in range(LAYERS)
    for part, shape in (
        ("self_attn.q_proj", (HIDDEN, HIDDEN)),
        ("self_attn.v_proj", (HIDDEN, HIDDEN)),
        ("mlp.gate_proj", (HIDDEN, 4 * HIDDEN)),
    )
}


def adapter(path, *, seed=1, rank=4, targets=("q_proj", "v_proj")):
    return make_adapter(
        path, path, shapes=SHAPES, seed=seed, rank=rank, targets=targets, config={"base_model_name_or_path": None}
    )


@pytest.fixture
def lora_engine(tmp_path, tiny_model_dir):
    """A build output with the LoRA plugin (attn_q, attn_v; max rank 8), `adapters/shout`
    beside it (DJL's layout) and a second adapter outside: (model dir, other adapter dir)."""
    out = make_engine_output(
        tmp_path / "out",
        tiny_model_dir,
        lora_target_modules=BUILT,
        max_lora_rank=8,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
    )
    adapter(out / "adapters" / "shout", seed=5)
    return out, adapter(tmp_path / "calm", seed=6)


def lora_requests(server, task_id):
    """The executor Requests of one task, in order: (request id, weights sent)."""
    ex = server.engine._executor
    return [
        (rid, r.lora_config.weights is not None)
        for rid, r in sorted(ex.fake_requests.items())
        if r.lora_config is not None and r.lora_config.task_id == task_id
    ]


@pytest.mark.parametrize("era", ERAS)
async def test_adapter_reaches_the_executor_with_its_task_id_and_weights_once(monkeypatch, tokenizer, lora_engine, era):
    trtllm_executor.install(monkeypatch, era)
    model, calm = lora_engine
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm", lora_modules=(("calm", str(calm)),)) as (
        server,
        stub,
    ):
        base = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6})))
        first = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="shout")))
        again = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, model="shout")))
        other = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="calm")))
        assert first == again != base
        assert other != first
        shout = server.engine._adapters["shout"].task_id
        calm_id = server.engine._adapters["calm"].task_id
        assert shout != calm_id
        assert [sent for _, sent in lora_requests(server, shout)] == [True, False]
        assert [sent for _, sent in lora_requests(server, calm_id)] == [True]
        ex = server.engine._executor
        assert ex.fake_peft.puts == [shout, calm_id]
        sent = ex.fake_requests[lora_requests(server, shout)[0][0]].lora_config
        assert tuple(sent.weights.shape) == (2 * LAYERS, 4 * (HIDDEN + HIDDEN))
        assert sent.config.tolist()[0] == [MODULE_IDS["attn_q"], 0, 4]
        peft = ex.config.peft_cache_config
        assert peft.num_device_module_layer == 4 * LAYERS * len(BUILT) and peft.max_adapter_size == 8
        info = await stub.ListAdapters(spb.ListAdaptersRequest())
        assert {a.name for a in info.adapters} == {"shout", "calm"} and info.max_loras == 4


@pytest.mark.parametrize("era", ERAS)
async def test_a_cache_miss_is_retried_once_with_the_weights(monkeypatch, tokenizer, lora_engine, era):
    trtllm_executor.install(monkeypatch, era)
    model, _ = lora_engine
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm") as (server, stub):
        first = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="shout")))
        task = server.engine._adapters["shout"].task_id
        ex = server.engine._executor
        ex.fake_peft.evict(task)  # the cache made room for other tasks
        again = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="shout")))
        assert again == first
        assert [sent for _, sent in lora_requests(server, task)] == [True, False, True]
        assert ex.fake_peft.puts == [task, task]


async def test_a_second_miss_of_one_request_fails_it(monkeypatch, tokenizer, lora_engine):
    tl = trtllm_executor.install(monkeypatch, "1.0")
    model, _ = lora_engine
    real = tl.LoraConfig

    class Stripped(real):  # an executor that loses every weight: each request misses
        def __init__(self, task_id, weights=None, config=None):
            super().__init__(task_id)

    monkeypatch.setattr(tl, "LoraConfig", Stripped)
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm") as (server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(stopping={"max_new_tokens": 4}, adapter="shout"))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "not found in cache" in info.value.details()
        assert len(lora_requests(server, server.engine._adapters["shout"].task_id)) == 2


async def test_a_refused_resend_fails_the_request_with_the_miss(monkeypatch, tokenizer, lora_engine):
    trtllm_executor.install(monkeypatch, "1.0")
    model, _ = lora_engine
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm") as (server, stub):
        await collect(stub, request(stopping={"max_new_tokens": 2}, adapter="shout"))
        ex = server.engine._executor
        ex.fake_peft.evict(server.engine._adapters["shout"].task_id)
        real = ex.enqueue_request

        def refuse_weights(r):
            if r.lora_config is not None and r.lora_config.weights is not None:
                raise RuntimeError("[TensorRT-LLM][ERROR] Shutdown called")
            return real(r)

        monkeypatch.setattr(ex, "enqueue_request", refuse_weights)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(stopping={"max_new_tokens": 2}, adapter="shout"))
        assert "not found in cache" in info.value.details()
        assert server.engine.stats().active == 0 and not server.engine._live


@pytest.mark.parametrize("era", ["0.11", "1.3"])
async def test_unknown_adapter_is_not_found(monkeypatch, tokenizer, lora_engine, era):
    trtllm_executor.install(monkeypatch, era)
    model, _ = lora_engine
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm") as (server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(stopping={"max_new_tokens": 4}, adapter="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()
        assert reason_of(info.value) == "ADAPTER_NOT_FOUND"
        assert not server.engine._executor.fake_requests


async def test_load_and_unload_at_run_time(monkeypatch, tokenizer, lora_engine, tmp_path):
    trtllm_executor.install(monkeypatch, "1.0")
    model, calm = lora_engine
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm", enable_lora_management=True) as (
        server,
        stub,
    ):
        loaded = await stub.LoadAdapter(spb.LoadAdapterRequest(name="calm", path=str(calm)))
        assert loaded.adapter.name == "calm" and loaded.adapter.rank == 4
        task = server.engine._adapters["calm"].task_id
        await collect(stub, request(stopping={"max_new_tokens": 3}, adapter="calm"))
        await stub.UnloadAdapter(spb.UnloadAdapterRequest(name="calm"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(stopping={"max_new_tokens": 3}, adapter="calm"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.LoadAdapter(spb.LoadAdapterRequest(name="calm", path=str(calm)))
        assert server.engine._adapters["calm"].task_id != task  # a fresh task: no stale cache entry
        cases = [
            (adapter(tmp_path / "mlp", targets=("gate_proj",)), "LORA_BASE_MODEL_MISMATCH", "gate_proj"),
            (adapter(tmp_path / "wide", rank=16), "LORA_RANK_TOO_LARGE", "max_lora_rank 8"),
        ]
        for path, reason, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.LoadAdapter(spb.LoadAdapterRequest(name=path.name, path=str(path)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason_of(info.value) == reason and words in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LoadAdapter(spb.LoadAdapterRequest(name="calm", path=str(calm)))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_an_engine_without_the_lora_plugin_serves_no_adapters(monkeypatch, tokenizer, tmp_path, tiny_model_dir):
    trtllm_executor.install(monkeypatch, "1.0")
    model = make_engine_output(tmp_path / "out", tiny_model_dir)
    async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm") as (server, stub):
        info = await stub.ListAdapters(spb.ListAdaptersRequest())
        assert info.max_loras == 0 and not info.adapters
        assert server.engine._executor.config.peft_cache_config is None
    adapter(model / "adapters" / "shout")
    with pytest.raises(RuntimeError, match="serves none"):
        async with serve_engine(trtllm.build, model, tokenizer, engine="trtllm"):
            pass


# --------------------------------------------------------------------------------- LLM API


@pytest.fixture
def llm_model(tmp_path, tiny_model_dir):
    """A copy of the tiny checkpoint with adapters/shout (DJL's layout): (model dir, shapes)."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    shapes = linear_shapes(model)
    make_adapter(model / "adapters" / "shout", model, shapes=shapes, seed=3, rank=4)
    return model, shapes


@pytest.mark.parametrize("release", ["1.0.0", "1.4.0"])
async def test_llm_api_sends_a_lora_request_per_request(monkeypatch, tokenizer, llm_model, release):
    fake = fake_llm.install(monkeypatch, version=release)
    model, _ = llm_model
    async with serve_engine(trtllm_llm.build, model, tokenizer, engine="trtllm-llm") as (server, stub):
        llm = fake.fake_instances[-1]
        config = llm.args.lora_config
        assert config.lora_dir == [str(model / "adapters" / "shout")]
        assert (config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (4, 4, 16)
        base = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6})))
        first = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="shout")))
        again = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, model="shout")))
        assert first == again != base
        lora_id = server.engine._adapters["shout"][1]
        sent = [r.lora_config for _, r in sorted(llm.fake_executor.fake_requests.items()) if r.lora_config]
        assert [(c.task_id, c.weights is not None) for c in sent] == [(lora_id, True), (lora_id, False)]
        assert llm.fake_lora_loads == [lora_id]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request(stopping={"max_new_tokens": 3}, adapter="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and reason_of(info.value) == "ADAPTER_NOT_FOUND"


async def test_llm_api_loads_adapters_at_run_time(monkeypatch, tokenizer, tiny_model_dir, llm_model, tmp_path):
    fake = fake_llm.install(monkeypatch)
    _, shapes = llm_model
    later = make_adapter(tmp_path / "later", tiny_model_dir, shapes=shapes, seed=4, rank=4)
    async with serve_engine(
        trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm", enable_lora_management=True
    ) as (_server, stub):
        config = fake.fake_instances[-1].args.lora_config
        assert config.lora_dir == [] and "attn_q" in config.lora_target_modules
        await stub.LoadAdapter(spb.LoadAdapterRequest(name="later", path=str(later)))
        base = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6})))
        adapted = tokens_of(await collect(stub, request(stopping={"max_new_tokens": 6}, adapter="later")))
        assert adapted != base
        await stub.UnloadAdapter(spb.UnloadAdapterRequest(name="later"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UnloadAdapter(spb.UnloadAdapterRequest(name="later"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.LoadAdapter(spb.LoadAdapterRequest(name="later", path=str(later)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LoadAdapter(spb.LoadAdapterRequest(name="later", path=str(later)))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_llm_api_without_adapters_takes_no_lora_config(monkeypatch, tokenizer, tiny_model_dir):
    fake = fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        assert fake.fake_instances[-1].args.lora_config is None
        info = await stub.ListAdapters(spb.ListAdaptersRequest())
        assert info.max_loras == 0
