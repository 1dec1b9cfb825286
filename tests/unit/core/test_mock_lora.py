"""Adapter residency, shared by the HF and mock engines (core.lora.AdapterSlots), and the mock
engine's use of it: `--max-loras` slots, least-recently-used eviction of an adapter none of
whose requests runs, and a request whose adapter finds no free slot waiting in the queue,
keeping its place, while the requests behind it run.

Order is read from the outputs: outputs of one engine step share their `time`, and a request
admitted at a step boundary gets its SCHEDULED output with that boundary's time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from core.engine.base import OutputStream
from core.engine.mock import MockEngine
from core.lora import AdapterSlots, AdapterSpec
from core.sampling import resolve_generic
from core.types import EngineOutput, EngineRequest, RequestState, SamplingOptions


def spec(name: str) -> AdapterSpec:
    return AdapterSpec(name, f"/adapters/{name}", 8, 2.0, ("q_proj",))


def req(rid: str, adapter: str = "", max_new: int = 4) -> EngineRequest:
    sampling = resolve_generic(SamplingOptions(), random_seed=0)
    return EngineRequest(rid, [1, 600, 601], sampling, max_new, adapter=adapter)


async def drain(stream: OutputStream) -> list[EngineOutput]:
    return [out async for out in stream]


def scheduled(outs: list[EngineOutput]) -> float:
    return next(o.time for o in outs if o.state is RequestState.SCHEDULED)


@pytest.fixture
async def two_slots(bpe_tokenizer) -> AsyncIterator[MockEngine]:
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=8, max_loras=2)
    await e.start()
    for name in ("a", "b", "c"):
        await e.load_adapter(spec(name))
    yield e
    await e.shutdown()


def residency(engine: MockEngine) -> dict[str, bool]:
    return {s.spec.name: s.resident for s in engine.adapters()}


# ---------------------------------------------------------------- AdapterSlots


def test_slots_fill_free_ones_then_evict_the_least_recently_used_idle_one():
    slots: AdapterSlots[str] = AdapterSlots(2)
    assert slots.assign("a", set()) == 0 and slots.assign("b", set()) == 1
    assert slots.assign("a", set()) == 0  # resident: its own slot, now the most recent
    assert slots.assign("c", set()) == 1  # b is the least recently used
    assert slots.held() == ["a", "c"]
    assert slots.assign("b", busy={0}) == 1  # a's slot is busy: c's goes
    assert slots.assign("d", busy={0, 1}) is None  # every slot runs another adapter
    assert slots.slot_of("d") is None
    assert slots.loads == 4  # a, b, c, b again: a resident adapter and a refusal load nothing


def test_forgetting_frees_an_idle_slot_only():
    slots: AdapterSlots[str] = AdapterSlots(2)
    slots.assign("a", set())
    slots.assign("b", set())
    slots.forget("a", busy={0})
    assert slots.held() == ["a", "b"]  # still running: freed later, by eviction
    slots.forget("b", busy={0})
    assert slots.held() == ["a"]
    assert slots.assign("c", busy={0}) == 1  # the freed slot


# ---------------------------------------------------------------- the mock engine


async def test_a_request_without_a_free_slot_waits_while_those_behind_it_run(two_slots):
    engine = two_slots
    long_a = engine.generate(req("long-a", "a", max_new=200))
    long_b = engine.generate(req("long-b", "b", max_new=400))
    blocked = engine.generate(req("c", "c"))
    base = engine.generate(req("base"))  # behind c in the queue, no adapter
    more_a = engine.generate(req("more-a", "a"))  # behind c, its adapter resident
    base_outs, more_a_outs = await drain(base), await drain(more_a)
    status = {s.spec.name: s for s in engine.adapters()}
    assert status["c"].waiting == 1 and not status["c"].resident
    assert status["a"].running == 1 and status["b"].running == 1
    long_a_outs, c_outs = await drain(long_a), await drain(blocked)
    # c ran only once a's last request left the batch, in the slot a held (b's still runs).
    assert scheduled(c_outs) >= long_a_outs[-1].time
    assert scheduled(base_outs) < long_a_outs[-1].time and scheduled(more_a_outs) < long_a_outs[-1].time
    assert residency(engine) == {"a": False, "b": True, "c": True}
    await drain(long_b)


async def test_the_least_recently_used_idle_adapter_is_evicted(two_slots):
    engine = two_slots
    await drain(engine.generate(req("1", "a")))
    await drain(engine.generate(req("2", "b")))
    await drain(engine.generate(req("3", "a")))  # a is now the most recently used
    await drain(engine.generate(req("4", "c")))
    assert residency(engine) == {"a": True, "b": False, "c": True}


async def test_an_unloaded_adapter_keeps_its_slot_until_its_requests_end(bpe_tokenizer):
    engine = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=8, max_loras=1)
    await engine.start()
    try:
        await engine.load_adapter(spec("a"))
        await engine.load_adapter(spec("b"))
        running = engine.generate(req("a", "a", max_new=10))
        await engine.unload_adapter("a")
        waiting = engine.generate(req("b", "b"))
        a_outs, b_outs = await drain(running), await drain(waiting)
        assert len([o for o in a_outs if o.sequences]) == 10  # it finished with its adapter
        assert scheduled(b_outs) >= a_outs[-1].time
        assert residency(engine) == {"b": True}
    finally:
        await engine.shutdown()
