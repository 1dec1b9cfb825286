"""LoRA adapters in the HF engine (core.engine.hf_lora): greedy tokens equal the base model's
with the adapter merged by peft, alone and with other adapters and the base model in the same
steps; slots shared by more adapters than fit; the prefix cache kept apart per adapter; and the
refusals of registration and of requests."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from core.engine import hf
from core.errors import AdapterExists, AdapterNotFound, InvalidArgument, NotReady
from core.lora import read_spec
from core.sampling import resolve_generic
from core.types import EngineRequest, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_idle
from tests.lora_helpers import linear_shapes, make_adapter, merged_greedy

STEPS = 8
# 20 and 37 tokens: past one prefix-cache block (16), so cached blocks are in play.
PROMPTS = [[1, *range(40, 59), 7], [1, *range(300, 336)]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three random adapters of the tiny model: q/v at rank 8, every Linear at rank 4, and
    o/down at rank 16 (rsLoRA scaling)."""
    root = tmp_path_factory.mktemp("adapters")
    shapes = linear_shapes(tiny_model_dir)
    return {
        "qv": make_adapter(root / "qv", tiny_model_dir, shapes=shapes, seed=1),
        "all": make_adapter(
            root / "all",
            tiny_model_dir,
            shapes=shapes,
            seed=2,
            rank=4,
            alpha=8,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        ),
        "od": make_adapter(
            root / "od",
            tiny_model_dir,
            shapes=shapes,
            seed=3,
            rank=16,
            targets=("o_proj", "down_proj"),
            config={"use_rslora": True},
        ),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """name ("" for the base) -> the greedy tokens of each prompt with that adapter merged."""
    out = {"": merged_greedy(tiny_model_dir, None, PROMPTS, STEPS)}
    for name, path in adapters.items():
        out[name] = merged_greedy(tiny_model_dir, path, PROMPTS, STEPS)
    return out


def spec(name, path, model_dir, max_rank=16):
    return read_spec(name, path, max_rank=max_rank, model_path=str(model_dir), served_model="tiny")


async def engine_with(model_dir, tokenizer, adapters, **overrides):
    e = hf.build(core_config(model_dir, **overrides), tokenizer)
    await e.start()
    for name, path in adapters.items():
        await e.load_adapter(spec(name, path, model_dir))
    return e


def req(rid: str, prompt: list[int], adapter: str = "") -> EngineRequest:
    sampling = resolve_generic(SamplingOptions(do_sample=False), random_seed=1)
    return EngineRequest(rid, prompt, sampling, STEPS, ignore_eos=True, adapter=adapter)


async def tokens(engine, r: EngineRequest) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(r):
        assert out.error is None, out.error
        for s in out.sequences:
            ids += s.token_ids
    return ids


def test_the_adapters_change_the_output(expected):
    assert expected["qv"] != expected[""] and expected["all"] != expected[""] and expected["od"] != expected[""]
    assert expected["qv"] != expected["all"]


@pytest.mark.parametrize(("max_loras", "max_lora_rank"), [(4, 16), (1, 16), (4, 128)])
async def test_greedy_tokens_equal_the_merged_model_alone_and_mixed(
    tiny_model_dir, tokenizer, adapters, expected, max_loras, max_lora_rank
):
    """With 4 slots every adapter stays resident; with 1 the adapters take turns in the slot
    (requests wait for it), and the base model's requests run alongside. Mixed steps are
    stacked (ranks x slots <= hf_lora.STACKED_COLUMNS) or, with rank 128, grouped."""
    e = await engine_with(tiny_model_dir, tokenizer, adapters, max_loras=max_loras, max_lora_rank=max_lora_rank)
    try:
        for name in ["", *adapters]:  # alone, one request at a time (each prompt cached after the first)
            for i, prompt in enumerate(PROMPTS):
                assert await tokens(e, req(f"{name}-{i}", prompt, name)) == expected[name][i], name
        names = ["", *adapters] * 2
        jobs = [tokens(e, req(f"mix-{k}", PROMPTS[k % 2], name)) for k, name in enumerate(names)]
        got = await asyncio.gather(*jobs)
        for k, name in enumerate(names):
            assert got[k] == expected[name][k % 2], (k, name)
        await wait_idle(e)
        status = {s.spec.name: s for s in e.adapters()}
        assert sorted(status) == sorted(adapters)
        assert sum(s.resident for s in status.values()) == min(max_loras, len(adapters))
        assert all(s.running == 0 and s.waiting == 0 for s in status.values())
    finally:
        await e.shutdown()


async def test_unknown_and_unloaded_adapters_are_not_found(tiny_model_dir, tokenizer, adapters, expected):
    e = await engine_with(tiny_model_dir, tokenizer, {"qv": adapters["qv"]}, max_loras=2)
    try:
        with pytest.raises(AdapterNotFound, match="'nope'") as info:
            e.generate(req("x", PROMPTS[0], "nope"))
        assert info.value.field == "adapter"
        assert await tokens(e, req("a", PROMPTS[0], "qv")) == expected["qv"][0]
        await e.unload_adapter("qv")
        assert not e.has_adapter("qv")
        with pytest.raises(AdapterNotFound):
            e.generate(req("b", PROMPTS[0], "qv"))
        with pytest.raises(AdapterNotFound):
            await e.unload_adapter("qv")
        # Registered again under the same name with other weights: nothing of the old one is reused.
        await e.load_adapter(spec("qv", adapters["all"], tiny_model_dir))
        assert await tokens(e, req("c", PROMPTS[0], "qv")) == expected["all"][0]
        with pytest.raises(AdapterExists):
            await e.load_adapter(spec("qv", adapters["qv"], tiny_model_dir))
    finally:
        await e.shutdown()


async def test_weights_that_do_not_fit_the_model_are_refused(tiny_model_dir, tokenizer, adapters, tmp_path):
    e = await engine_with(tiny_model_dir, tokenizer, {}, max_loras=2, max_lora_rank=8)
    try:
        shapes = {"model.layers.0.self_attn.q_proj": (64, 128)}
        wrong = make_adapter(tmp_path / "wrong", tiny_model_dir, shapes=shapes, targets=("q_proj",))
        with pytest.raises(InvalidArgument, match="does not fit") as info:
            await e.load_adapter(spec("wrong", wrong, tiny_model_dir))
        assert info.value.reason == "LORA_BASE_MODEL_MISMATCH" and info.value.field == "path"
        absent = make_adapter(
            tmp_path / "absent", tiny_model_dir, shapes={"model.layers.9.self_attn.q_proj": (128, 128)}
        )
        with pytest.raises(InvalidArgument, match="does not have"):
            await e.load_adapter(spec("absent", absent, tiny_model_dir))
        emb = make_adapter(
            tmp_path / "emb", tiny_model_dir, shapes={"model.embed_tokens": (4096, 128)}, targets=("embed_tokens",)
        )
        with pytest.raises(InvalidArgument, match="only Linear layers"):
            await e.load_adapter(spec("emb", emb, tiny_model_dir))
        empty = make_adapter(tmp_path / "empty", tiny_model_dir, targets=("nothing",))
        with pytest.raises(InvalidArgument, match="has no weights"):
            await e.load_adapter(spec("empty", empty, tiny_model_dir))
        # The config says rank 8, the weights carry rank 16: the engine's own bound holds.
        big = make_adapter(tmp_path / "big", tiny_model_dir, rank=16, config={"r": 8})
        with pytest.raises(InvalidArgument, match="above --max-lora-rank") as info:
            await e.load_adapter(spec("big", big, tiny_model_dir, max_rank=16))
        assert info.value.reason == "LORA_RANK_TOO_LARGE"
        gone = shutil.copytree(adapters["qv"], tmp_path / "gone")
        s = spec("gone", gone, tiny_model_dir)
        (gone / "adapter_model.safetensors").unlink()
        with pytest.raises(AdapterNotFound):
            await e.load_adapter(s)
        assert e.adapters() == []
    finally:
        await e.shutdown()


async def test_adapters_need_a_loaded_model(tiny_model_dir, tokenizer, adapters):
    e = hf.build(core_config(tiny_model_dir), tokenizer)  # not started: no model yet
    with pytest.raises(NotReady):
        e.add_adapter(spec("qv", adapters["qv"], tiny_model_dir))


def test_config_refusals(tiny_model_dir, adapters, tmp_path):
    with pytest.raises(InvalidArgument, match="above this server's --max-lora-rank 4") as info:
        spec("qv", adapters["qv"], tiny_model_dir, max_rank=4)
    assert info.value.reason == "LORA_RANK_TOO_LARGE"
    other = make_adapter(tmp_path / "other", tiny_model_dir, config={"base_model_name_or_path": "org/other-model"})
    with pytest.raises(InvalidArgument, match="trained on 'org/other-model'") as info:
        spec("other", other, tiny_model_dir)
    assert info.value.reason == "LORA_BASE_MODEL_MISMATCH"
    hub = make_adapter(tmp_path / "hub", tiny_model_dir, config={"base_model_name_or_path": "org/tiny"})
    assert spec("hub", hub, tiny_model_dir).base_model == "org/tiny"  # the served name, from the hub
    for key, value in (("use_dora", True), ("rank_pattern", {"q_proj": 4}), ("peft_type", "IA3"), ("r", 0)):
        bad = make_adapter(tmp_path / key, tiny_model_dir, config={key: value})
        with pytest.raises(InvalidArgument):
            spec(key, bad, tiny_model_dir)
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "adapter_config.json").write_text("{")
    (tmp_path / "notjson" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidArgument, match="not readable JSON"):
        spec("notjson", tmp_path / "notjson", tiny_model_dir)
    with pytest.raises(AdapterNotFound, match="No PEFT adapter") as nf:
        spec("none", tmp_path / "missing", tiny_model_dir)
    assert nf.value.field == "path"
    for name in ("", "a b", "x" * 129, "tiny"):
        with pytest.raises(InvalidArgument) as info:
            spec(name, adapters["qv"], tiny_model_dir)
        assert info.value.field == "name"
    assert json.loads((adapters["qv"] / "adapter_config.json").read_text())["r"] == 8
