"""The HF engine at token level on the tiny model: admission refusals, a failed step, a dead
worker and shutdown (the paths the gRPC tests cannot reach through validation)."""

from __future__ import annotations

import pytest

from core.engine import hf
from core.errors import EngineDead, EngineFailure, InvalidArgument, NotReady
from core.sampling import resolve_generic
from core.tokenizer import Tokenizer
from core.types import EngineOutput, EngineRequest, FinishReason, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


@pytest.fixture
async def engine(tiny_model_dir, tokenizer):
    """A started HF engine of its own (shut down afterwards, whatever the test did to it)."""
    e = hf.build(core_config(tiny_model_dir), tokenizer)
    await e.start()
    yield e
    await e.shutdown()


def req(request_id: str, prompt: list[int], max_new_tokens: int = 4, n: int = 1) -> EngineRequest:
    sampling = resolve_generic(SamplingOptions(), random_seed=1)
    return EngineRequest(request_id, prompt, sampling, max_new_tokens, num_sequences=n, ignore_eos=True)


async def until_tokens(gen) -> None:
    """Consume outputs until one carries tokens."""
    async for out in gen:
        if any(s.token_ids for s in out.sequences):
            return
    raise AssertionError("the request ended without tokens")


async def last_output(gen) -> EngineOutput:
    outs = [out async for out in gen]
    return outs[-1]


async def test_refused_before_start(tiny_model_dir, tokenizer):
    e = hf.build(core_config(tiny_model_dir), tokenizer)
    with pytest.raises(NotReady):
        e.generate(req("early", [1, 5]))


async def test_a_running_request_id_is_refused_until_it_ends(engine):
    gen = engine.generate(req("dup", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    with pytest.raises(InvalidArgument, match="already running") as info:
        engine.generate(req("dup", [1, 5]))
    assert info.value.field == "request_id"
    await gen.aclose()  # the consumer leaves: the engine aborts the request
    await wait_idle(engine)
    out = await last_output(engine.generate(req("dup", [1, 5])))
    assert out.finished and out.sequences[0].finish_reason is FinishReason.LENGTH


async def test_more_than_the_batch_can_hold_is_refused(engine):
    with pytest.raises(InvalidArgument) as info:
        engine.generate(req("wide", [1, 5], n=99))
    assert info.value.field == "sampling.n"


async def test_a_failed_step_fails_its_request_not_the_engine(engine):
    out = await last_output(engine.generate(req("bad", [1, 10**6])))  # an id past the embedding table
    assert isinstance(out.error, EngineFailure) and "Generation failed" in str(out.error)
    assert engine.alive
    out = await last_output(engine.generate(req("good", [1, 5])))
    assert out.finished and out.error is None
    await wait_idle(engine)


async def test_a_dead_worker_fails_its_requests_and_reports_once(engine, monkeypatch):
    deaths: list[Exception] = []
    engine.set_on_dead(deaths.append)
    gen = engine.generate(req("victim", [1, 5], max_new_tokens=900))
    await until_tokens(gen)

    def broken(emits):  # outside the per-step guard: the worker itself fails
        raise RuntimeError("worker bug")

    monkeypatch.setattr(engine, "_finish_step", broken)
    out = await last_output(gen)
    assert isinstance(out.error, EngineDead) and "worker bug" in str(out.error)
    await wait_for(lambda: deaths)
    assert [str(d) for d in deaths] == ["worker bug"] and not engine.alive
    with pytest.raises(EngineDead):
        engine.generate(req("after", [1, 5]))


async def test_shutdown_ends_running_requests_with_not_ready(engine):
    gen = engine.generate(req("running", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    await engine.shutdown()
    out = await last_output(gen)
    assert isinstance(out.error, NotReady) and not engine.alive
    with pytest.raises(NotReady):
        engine.generate(req("late", [1, 5]))
