"""What the engines share (core.engine.base): the output queue, liveness, prompt logprobs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.engine.base import EngineLifecycle, OutputStream, prompt_logprobs
from core.errors import EngineDead, NotReady
from core.types import EngineOutput, RequestState

QUEUED = EngineOutput("r", state=RequestState.QUEUED)


async def test_the_stream_ends_on_the_final_output():
    closed: list[bool] = []
    stream = OutputStream(QUEUED, closed.append)
    stream.put(EngineOutput("r"))
    stream.put(EngineOutput("r", finished=True))
    stream.put(EngineOutput("r", error=RuntimeError("late")))  # after the final one: never handed over
    outs = [out async for out in stream]
    assert [(o.state, o.finished, o.error) for o in outs] == [
        (RequestState.QUEUED, False, None),
        (None, False, None),
        (None, True, None),
    ]
    assert closed == [True]
    await stream.aclose()
    assert closed == [True]  # reported once


async def test_an_error_output_is_final():
    closed: list[bool] = []
    stream = OutputStream(QUEUED, closed.append)
    stream.put(EngineOutput("r", error=RuntimeError("boom")))
    outs = [out async for out in stream]
    assert str(outs[-1].error) == "boom" and closed == [True]


async def test_closing_before_the_final_output_reports_an_abandoned_request():
    closed: list[bool] = []
    stream = OutputStream(QUEUED, closed.append)
    assert (await anext(stream)) is QUEUED
    await stream.aclose()
    assert closed == [False] and stream.closed
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_closing_a_stream_never_iterated_still_releases_the_request():
    closed: list[bool] = []
    await OutputStream(QUEUED, closed.append).aclose()
    assert closed == [False]


async def test_a_consumer_cancelled_while_waiting_releases_the_request():
    closed: list[bool] = []
    stream = OutputStream(QUEUED, closed.append)
    await anext(stream)
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # let it start waiting
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert closed == [False]


def test_lifecycle_refuses_by_state():
    e = EngineLifecycle()
    deaths = []
    e.set_on_dead(deaths.append)
    with pytest.raises(NotReady):  # not started
        e._check_serving()
    e._started = e._alive = True
    e._check_serving()
    error = RuntimeError("gone")
    assert e._mark_dead(error) and not e._mark_dead(error)  # reported once
    assert deaths == [error] and not e.alive
    with pytest.raises(EngineDead):
        e._check_serving()
    e._stopping = True
    with pytest.raises(NotReady):
        e._check_serving()


def test_prompt_logprobs_of_every_token_but_the_first():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    infos = prompt_logprobs(logits, [1, 2, 0], k=2)
    assert [(i.token_id, i.logprob is None) for i in infos] == [(1, True), (2, False), (0, False)]
    assert infos[1].logprob == pytest.approx(float(logits[0].log_softmax(-1)[2]))
    assert infos[2].logprob == pytest.approx(float(logits[1].log_softmax(-1)[0]))
    assert [t for t, _ in infos[1].top] == [2, 1] and infos[2].top[0][0] == 0


def test_alternatives_leave_out_vocabulary_padding():
    logits = torch.tensor([[0.0, 1.0, 9.0], [0.0, 0.0, 0.0]])  # column 2 pads the vocabulary
    assert [t for t, _ in prompt_logprobs(logits, [1, 0], k=2, vocab=2)[1].top] == [1, 0]


def test_prompt_logprobs_of_a_one_token_prompt():
    assert [(i.token_id, i.logprob, i.top) for i in prompt_logprobs(torch.zeros(1, 5), [4], k=3)] == [(4, None, [])]


def test_an_attached_handler_gets_waiting_outputs_first_then_each_as_it_is_put():
    closed: list[bool] = []
    got: list[EngineOutput] = []
    stream = OutputStream(QUEUED, closed.append)
    middle = EngineOutput("r")
    stream.put(middle)
    stream.attach(got.append)
    assert got == [QUEUED, middle] and closed == []
    final = EngineOutput("r", finished=True)
    stream.put(final)
    stream.put(EngineOutput("r"))  # after the final one: never handed over
    assert got == [QUEUED, middle, final] and closed == [True]


def test_closing_an_attached_stream_aborts_the_request_and_stops_deliveries():
    closed: list[bool] = []
    got: list[EngineOutput] = []
    stream = OutputStream(QUEUED, closed.append)
    stream.attach(got.append)
    stream.close()
    stream.put(EngineOutput("r", finished=True))
    assert got == [QUEUED] and closed == [False]
