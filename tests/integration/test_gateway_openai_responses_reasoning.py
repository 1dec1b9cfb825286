"""Reasoning on the Responses API (`--reasoning-parser qwen3`), with the official `openai` SDK
against a gateway on a mock core whose scripted replies hold `<think>` blocks split over several
tokens (conftest SCRIPT): a `reasoning` output item (`reasoning_text` content, empty summary)
before the answer, its `response.reasoning_text.delta` / `.done` events inside
`output_item.added` / `content_part.added` ... `content_part.done` / `output_item.done` (every
raw event parsed with the SDK's ResponseStreamEvent union), reasoning before a function call
and the chain continued through `previous_response_id` and as items, a reasoning block cut
short by the budget, and reasoning items in the input refused when they carry
`encrypted_content`."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
import pytest_asyncio
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

EVENT = TypeAdapter(ResponseStreamEvent)
THINKING = "Two and two\nmake four."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

REASONING_ORDER = [
    "response.output_item.added",
    "response.content_part.added",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
TEXT_ORDER = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest_asyncio.fixture
async def scripted(scripted_url):
    client = openai.AsyncOpenAI(base_url=f"{scripted_url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


def squeeze(types):
    """The event types with runs of one type collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


async def raw_events(url: str, body: dict) -> list:
    """POST a streamed Responses body and parse each SSE event with the SDK's event union,
    checking that each `event:` name is its data's `type`."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/responses", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        text = await r.text()
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(EVENT.validate_python(data))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def shapes(output) -> list[dict]:
    """Output items without their ids (a stream's and a whole response's differ only there)."""
    return [{k: v for k, v in item.model_dump().items() if k != "id"} for item in output]


async def test_a_reasoning_item_before_the_message(scripted):
    resp = await scripted.responses.create(model="mock", input="Think first", max_output_tokens=100)
    assert resp.status == "completed" and [i.type for i in resp.output] == ["reasoning", "message"]
    reasoning, message = resp.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THINKING)]
    assert reasoning.encrypted_content is None
    assert resp.output_text == "The answer is 4." and message.status == "completed"
    # Stored as answered.
    assert (await scripted.responses.retrieve(resp.id)).output == resp.output


async def test_reasoning_text_events_in_order(scripted, scripted_url):
    events = await raw_events(scripted_url, {"model": "mock", "input": "Think first", "max_output_tokens": 100})
    types = [e.type for e in events]
    head = ["response.created", "response.in_progress"]
    assert squeeze(types) == [*head, *REASONING_ORDER, *TEXT_ORDER, "response.completed"]
    added, part_added = events[2], events[3]
    assert added.item.type == "reasoning" and added.item.content == [] and added.item.summary == []
    assert added.output_index == 0 and added.item.status == "in_progress"
    assert part_added.part.type == "reasoning_text" and part_added.part.text == ""
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == THINKING
    assert not any(set(e.delta) & set("<>") for e in deltas)  # the tags' pieces are held back
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(added.item.id, 0, 0)}
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    part_done = next(e for e in events if e.type == "response.content_part.done")
    item_done = next(e for e in events if e.type == "response.output_item.done")
    assert done.text == THINKING and part_done.part.text == THINKING and part_done.part.type == "reasoning_text"
    assert item_done.item.type == "reasoning" and item_done.item.content[0].text == THINKING
    assert item_done.item.status == "completed"
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.output_index for e in text} == {1} and "".join(e.delta for e in text) == "The answer is 4."
    final = events[-1].response
    whole = await scripted.responses.create(model="mock", input="Think first", max_output_tokens=100)
    assert shapes(final.output) == shapes(whole.output)


async def test_the_sdk_stream_helper_reads_reasoning(scripted):
    async with scripted.responses.stream(model="mock", input="Think first", max_output_tokens=100) as stream:
        pieces = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
        final = await stream.get_final_response()
    assert "".join(pieces) == THINKING
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "The answer is 4."


async def test_reasoning_then_a_function_call_and_the_chain_goes_on(scripted, scripted_url):
    ask = "Think, then call"
    first = await scripted.responses.create(model="mock", input=ask, tools=[WEATHER], max_output_tokens=100)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.content[0].text == "I need the weather."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    events = await raw_events(
        scripted_url, {"model": "mock", "input": ask, "tools": [WEATHER], "max_output_tokens": 100}
    )
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "It is 3 C"}
    # Chained: the stored conversation holds the reasoning item, which stays out of the prompt.
    second = await scripted.responses.create(
        model="mock", previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=100
    )
    assert second.output_text == "It is cold in Oslo: 3 C."
    # As items: the earlier output passed back whole, its reasoning item included.
    echoed = [i.model_dump(exclude_none=True) for i in first.output]
    third = await scripted.responses.create(
        model="mock",
        input=[{"role": "user", "content": ask}, *echoed, result],
        tools=[WEATHER],
        max_output_tokens=100,
    )
    assert third.output_text == second.output_text
    assert third.usage.input_tokens == second.usage.input_tokens
    items = await scripted.responses.input_items.list(third.id, order="asc")
    assert [i.type for i in items.data] == ["message", "reasoning", "function_call", "function_call_output"]
    assert items.data[1].id == reasoning.id


async def test_reasoning_cut_short_by_the_budget(scripted, scripted_url):
    resp = await scripted.responses.create(model="mock", input="Think first", max_output_tokens=9)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in resp.output] == [("reasoning", "completed"), ("message", "incomplete")]
    thought = resp.output[0].content[0].text
    assert resp.output_text == "" and thought and THINKING.startswith(thought)
    events = await raw_events(scripted_url, {"model": "mock", "input": "Think first", "max_output_tokens": 9})
    assert events[-1].type == "response.incomplete"
    assert shapes(events[-1].response.output) == shapes(resp.output)


async def test_no_reasoning_item_without_reasoning(scripted):
    resp = await scripted.responses.create(model="mock", input="Say hi", max_output_tokens=100)
    assert [i.type for i in resp.output] == ["message"] and resp.output_text == "Hello there."


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "summary": [], "encrypted_content": "abc"}, "input[0].encrypted_content"),
        ({"type": "reasoning", "summary": [{"type": "summary_text"}]}, "input[0].summary[0].text"),
        ({"type": "reasoning", "content": []}, "input[0].summary"),
    ],
)
async def test_bad_reasoning_items_are_named(scripted, item, param):
    with pytest.raises(openai.BadRequestError) as err:
        await scripted.responses.create(model="mock", input=[item, {"role": "user", "content": "Say hi"}])
    assert err.value.param == param and err.value.type == "invalid_request_error"
