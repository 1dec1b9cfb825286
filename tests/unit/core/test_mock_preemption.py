"""The mock engine's preemption and full-queue displacement (core.scheduling's rules): who is
preempted, that a preempted request's stream continues exactly, and who a full queue refuses."""

from __future__ import annotations

import asyncio

import pytest

from core.engine.base import OutputStream
from core.engine.mock import MockEngine
from core.errors import Overloaded
from core.lora import AdapterSpec
from core.types import EngineOutput, FinishReason, RequestState
from tests.unit.core.test_mock_engine import drain, req, tokens


async def until_tokens(stream: OutputStream, n: int) -> list[EngineOutput]:
    """Read `stream` until it has given `n` tokens."""
    outs: list[EngineOutput] = []
    while len(tokens(outs)) < n:
        outs.append(await anext(stream))
    return outs


async def engine_of(bpe_tokenizer, **kwargs) -> MockEngine:
    e = MockEngine(bpe_tokenizer, **{"step_ms": 1.0, "max_batch_size": 1, "max_queue_size": 8, **kwargs})
    await e.start()
    return e


@pytest.mark.parametrize("seed", [None, 11])
async def test_a_higher_priority_request_preempts_and_the_stream_continues_exactly(bpe_tokenizer, seed):
    e = await engine_of(bpe_tokenizer, scheduling_policy="priority")
    try:
        alone = tokens(await drain(e.generate(req("alone", seed=seed, max_new=30))))
        low = e.generate(req("low", seed=seed, max_new=30))
        first = await until_tokens(low, 3)
        high = await drain(e.generate(req("high", [1, 700], max_new=3, priority=-1)))
        rest = await drain(low)
    finally:
        await e.shutdown()
    outs = first + rest
    assert tokens(outs) == alone  # no token repeated, lost or changed
    assert sum(o.preempted for o in outs) == 1
    states = [o.state for o in outs if o.state is not None]
    assert states == [RequestState.QUEUED, RequestState.SCHEDULED, RequestState.PREFILLED]  # once each
    assert high[-1].finished and len(tokens(high)) == 3
    assert high[-1].time < outs[-1].time  # high ran while low waited


async def test_fcfs_with_one_tenant_and_no_preemption_flag_never_preempt(bpe_tokenizer):
    for kwargs in ({}, {"scheduling_policy": "priority", "preemption": False}):
        e = await engine_of(bpe_tokenizer, **kwargs)
        try:
            first = e.generate(req("first", max_new=10))
            head = await until_tokens(first, 2)
            later = e.generate(req("later", max_new=2, priority=-1))
            outs = head + await drain(first)
            second = await drain(later)
        finally:
            await e.shutdown()
        assert not any(o.preempted for o in outs + second)
        assert outs[-1].time < second[-1].time  # the running request ran to its end first
        assert e.info.preemption is kwargs.get("preemption", True)


async def test_a_tenant_under_its_share_preempts_the_tenant_over_it(bpe_tokenizer):
    e = await engine_of(bpe_tokenizer, max_batch_size=2)
    try:
        a = [e.generate(req(f"a{i}", [1, 600 + i], max_new=40, tenant="a")) for i in range(3)]
        heads = [await until_tokens(s, 2) for s in a[:2]]
        b = await drain(e.generate(req("b", [1, 700], max_new=3, tenant="b")))
        rest = [await drain(s) for s in a]
    finally:
        await e.shutdown()
    assert [any(o.preempted for o in outs) for outs in rest] == [False, True, False]  # a's newest running
    assert not any(o.preempted for o in heads[0] + heads[1] + b)
    assert b[-1].time < rest[1][-1].time
    assert [len(tokens(h + r)) for h, r in zip(heads, rest[:2], strict=True)] == [40, 40]


async def test_a_full_queue_displaces_the_newest_of_the_tenant_over_its_share(bpe_tokenizer):
    e = await engine_of(bpe_tokenizer, max_queue_size=2)
    try:
        running = e.generate(req("a0", max_new=20, tenant="a"))
        await until_tokens(running, 1)
        a1, a2 = (e.generate(req(f"a{i}", max_new=1, tenant="a")) for i in (1, 2))
        with pytest.raises(Overloaded):  # a holds the whole queue, its share alone
            e.generate(req("a3", tenant="a"))
        b = e.generate(req("b", max_new=1, tenant="b"))
        displaced = await drain(a2)
        assert isinstance(displaced[-1].error, Overloaded) and displaced[-1].finished
        assert "gave its place" in str(displaced[-1].error)
        with pytest.raises(Overloaded):  # a and b hold one each, c's share of 2 would be 2/3
            e.generate(req("c", tenant="c"))
        e.abort("a0")
        await asyncio.gather(drain(running), drain(a1), drain(b))
        assert e.stats().queued == 0
    finally:
        await e.shutdown()


async def test_a_preempted_request_cancelled_while_it_waits_ends_cancelled(bpe_tokenizer):
    e = await engine_of(bpe_tokenizer, scheduling_policy="priority")
    try:
        low = e.generate(req("low", max_new=40, tenant="t"))
        head = await until_tokens(low, 2)
        high = e.generate(req("high", [1, 700], max_new=40, priority=-1, tenant="u"))
        head.append(await anext(low))
        while not head[-1].preempted:
            head.append(await anext(low))
        e.abort("low")
        rest = await drain(low)
        assert rest[-1].finished and rest[-1].sequences[0].finish_reason is FinishReason.CANCELLED
        assert len(tokens(head)) < 40 and e.stats().queued == 0
        high.close()
    finally:
        await e.shutdown()


async def test_a_preempted_request_gives_up_its_adapter_slot_and_takes_one_again(bpe_tokenizer):
    """With one adapter slot, a high-priority request with another adapter preempts the running
    one, evicts its idle adapter, and the preempted request reloads it and continues exactly."""
    e = await engine_of(bpe_tokenizer, scheduling_policy="priority", max_loras=1)
    try:
        for name in ("a", "b"):
            await e.load_adapter(AdapterSpec(name, f"/adapters/{name}", 8, 2.0, ("q_proj",)))
        alone = tokens(await drain(e.generate(req("alone", max_new=30, adapter="a"))))
        low = e.generate(req("low", max_new=30, adapter="a"))
        first = await until_tokens(low, 3)
        high = await drain(e.generate(req("high", [1, 700], max_new=3, priority=-1, adapter="b")))
        rest = await drain(low)
    finally:
        await e.shutdown()
    outs = first + rest
    assert tokens(outs) == alone
    assert sum(o.preempted for o in outs) == 1
    assert high[-1].finished and len(tokens(high)) == 3 and high[-1].time < outs[-1].time
