"""OpenAI's Responses API on the OpenAI gateway, with the official `openai` SDK (its own types
parse every object and event) against a real gateway and the shared in-process core (HF engine
on the tiny untrained model): create with string and item input, streaming event order,
`responses.parse` with a pydantic model, a function-tool round trip through
`previous_response_id`, retrieve / delete / input_items, and the errors.

The tiny model writes nonsense, so structured outputs use bounded schemas (as
test_structured_outputs.py does) and tests compare shapes, not text.
"""

from __future__ import annotations

import json
from typing import Literal

import aiohttp
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Reading(BaseModel):
    """What `responses.parse` gets back (a bounded schema)."""

    place: str = Field(max_length=6)
    celsius: int = Field(ge=-40, le=50)
    wind: Literal["none", "light", "strong"]


def check_response(resp, status=None):
    """A finished response's shape; `status` None: completed, or incomplete with the budget
    spent (the untrained model rarely ends by itself)."""
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == MODEL and resp.created_at > 0
    assert resp.status == (status or resp.status) and resp.error is None
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage.output_tokens == resp.max_output_tokens
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    u = resp.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    # Prompt tokens the core's prefix cache held (a chain resends its history): whole blocks.
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


# --------------------------------------------------------------------------- create


async def test_create_with_a_string_input(aclient):
    resp = await aclient.responses.create(model=MODEL, input="Tell me about gardens.", max_output_tokens=20)
    check_response(resp)
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == resp.status
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert resp.output_text == part.text
    assert resp.store is True
    assert resp.text.format.type == "text" and resp.tool_choice == "auto" and resp.tools == []


async def test_create_with_items_instructions_and_a_budget(aclient):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": [{"type": "input_text", "text": "Be kind."}]},
        {"role": "user", "content": "More?"},
    ]
    resp = await aclient.responses.create(
        model=MODEL,
        input=items,
        instructions="You are a gardener.",
        max_output_tokens=1,
        temperature=0.5,
        top_p=0.9,
        metadata={"ticket": "7"},
        user="ann",
    )
    check_response(resp, "incomplete")
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 1
    assert resp.instructions == "You are a gardener." and resp.max_output_tokens == 1
    assert resp.temperature == 0.5 and resp.top_p == 0.9
    assert resp.metadata == {"ticket": "7"} and resp.user == "ann"
    # The instructions and every item reached the chat template.
    short = await aclient.responses.create(model=MODEL, input="More?", max_output_tokens=1)
    assert resp.usage.input_tokens > short.usage.input_tokens + 10


async def test_request_id_header_is_the_response_id(aclient):
    raw = await aclient.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id


# --------------------------------------------------------------------------- streaming

TEXT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def squeeze(types):
    """The event types with runs of one type collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


async def test_stream_events_in_order(aclient):
    async with aclient.responses.stream(model=MODEL, input="Tell me about gardens.", max_output_tokens=8) as stream:
        events = [event async for event in stream]
    types = [e.type for e in events]
    # The untrained model runs to the budget: the SDK's get_final_response() wants
    # response.completed, so the final response is the last event's.
    assert squeeze(types) == [*TEXT_ORDER, "response.incomplete"]
    final = events[-1].response
    check_response(final, "incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert {e.item_id for e in deltas} == {final.output[0].id}
    assert final.id == events[0].response.id and final.output[0].status == "incomplete"


async def test_stream_a_parsed_response(aclient):
    async with aclient.responses.stream(
        model=MODEL, input="Weather?", text_format=Reading, max_output_tokens=80
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert squeeze([e.type for e in events]) == [*TEXT_ORDER, "response.completed"]
    check_response(final, "completed")
    assert isinstance(final.output_parsed, Reading)
    assert (await aclient.responses.retrieve(final.id)).output_text == final.output_text


async def test_stream_with_create_and_raw_sse(aclient, base_url):
    stream = await aclient.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    types = [event.type async for event in stream]
    assert types[:2] == ["response.created", "response.in_progress"]
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/responses", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        raw = (await r.read()).decode()
    for block in raw.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"


# --------------------------------------------------------------------------- structured output


async def test_parse_with_a_pydantic_model(aclient):
    resp = await aclient.responses.parse(model=MODEL, input="Weather?", text_format=Reading, max_output_tokens=80)
    assert resp.status == "completed"
    assert isinstance(resp.output_parsed, Reading)
    assert Reading.model_validate_json(resp.output_text) == resp.output_parsed
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "Reading"


async def test_json_object_format(aclient):
    resp = await aclient.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_object"}}, max_output_tokens=60
    )
    assert resp.output_text.startswith("{")


# --------------------------------------------------------------------------- function tools


async def test_function_call_round_trip_with_previous_response_id(aclient):
    first = await aclient.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    check_response(first, "completed")
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    assert first.parallel_tool_calls is False

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3 C"}
    second = await aclient.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # The chain's first input, its call and the result are all in the prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = await aclient.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    assert items.data[0].call_id == call.call_id and items.data[0].output == "3 C"


async def test_function_call_with_items_in_one_request(aclient):
    """A caller that keeps the conversation itself sends the call and its output as items."""
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "3 C"}]},
    ]
    resp = await aclient.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=3)
    assert resp.status in ("completed", "incomplete")


async def test_streamed_function_call_events(aclient):
    named = {"type": "function", "name": "get_weather"}
    async with aclient.responses.stream(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice=named, max_output_tokens=60
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    types = squeeze([e.type for e in events])
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final.output
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert final.tool_choice.name == "get_weather"


# --------------------------------------------------------------------------- stored responses


async def test_retrieve_input_items_and_delete(aclient):
    items = [{"role": "user", "content": f"Line {i}"} for i in range(3)]
    resp = await aclient.responses.create(model=MODEL, input=items, max_output_tokens=2)
    got = await aclient.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()

    listed = await aclient.responses.input_items.list(resp.id)
    assert [i.content[0].text for i in listed.data] == ["Line 2", "Line 1", "Line 0"]
    assert all(i.type == "message" and i.role == "user" and i.id for i in listed.data)
    assert listed.first_id == listed.data[0].id and listed.has_more is False
    page = await aclient.responses.input_items.list(resp.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Line 0", "Line 1"] and page.has_more
    rest = await aclient.responses.input_items.list(resp.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Line 2"]

    await aclient.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await aclient.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await aclient.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await aclient.responses.input_items.list(resp.id)


async def test_a_streamed_response_is_stored_before_it_ends(aclient):
    async with aclient.responses.stream(model=MODEL, input="Hi", max_output_tokens=3) as stream:
        events = [event async for event in stream]
    final = events[-1].response
    assert (await aclient.responses.retrieve(final.id)).model_dump() == final.model_dump()


async def test_store_false_keeps_nothing(aclient):
    resp = await aclient.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        await aclient.responses.retrieve(resp.id)


async def test_the_memory_store_keeps_the_most_recent(start_gateway):
    url = await start_gateway("openai", response_store_max=1)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        first = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        second = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        assert (await client.responses.retrieve(second.id)).id == second.id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)


async def test_response_store_none_keeps_nothing(start_gateway):
    url = await start_gateway("openai", response_store="none")
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        resp = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(resp.id)


# --------------------------------------------------------------------------- errors


async def test_unknown_previous_response_is_404(aclient):
    with pytest.raises(openai.NotFoundError) as err:
        await aclient.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert err.value.param == "previous_response_id" and err.value.code == "previous_response_not_found"
    assert err.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"extra_body": {"seed": 3}}, "seed", "unknown_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice.type", None),
        ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", None),
        ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name", None),
        ({"temperature": 3}, "temperature", None),
        ({"max_output_tokens": "9"}, "max_output_tokens", None),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", None),
        ({"truncation": "auto"}, "truncation", None),
        ({"top_p": 0}, "top_p", None),
        ({"model": "gpt-4o"}, "model", "model_not_found"),
        (
            {"text": {"format": {"type": "json_schema", "name": "b", "schema": {"type": "objectx"}}}},
            "text.format",
            None,
        ),
        ({"tools": [{**WEATHER, "parameters": {"type": "objectx"}}], "tool_choice": "required"}, "tools", None),
    ],
)
async def test_bad_fields_are_named(aclient, kwargs, param, code):
    kwargs = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
        await aclient.responses.create(**kwargs)
    assert err.value.param == param
    assert err.value.code == (code or err.value.code)
    assert err.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "web_search_call", "id": "ws_1", "status": "completed"}, "input[0].type"),
        ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
        ({"role": "tool", "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
        ({"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}, "input[0].content[0].image_url"),
        ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input[0].content[0].type"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "input[0].output"),
    ],
)
async def test_bad_items_are_named(aclient, item, param):
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.responses.create(model=MODEL, input=[item])
    assert err.value.param == param


async def test_missing_input_and_bad_bodies(base_url):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base_url}/v1/responses", json={"model": MODEL}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"
        async with s.post(f"{base_url}/v1/responses", json=[1]) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(f"{base_url}/v1/responses", data="{", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        async with s.get(f"{base_url}/v1/responses/resp_x", params={"stream": "true"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "stream"
        for query, param in (({"limit": "0"}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after")):
            created = await s.post(
                f"{base_url}/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 1}
            )
            rid = (await created.json())["id"]
            async with s.get(f"{base_url}/v1/responses/{rid}/input_items", params=query) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_streaming_errors_before_the_first_byte_have_a_status(aclient):
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.responses.create(model=MODEL, input="Hi", top_p=0, stream=True)
    assert err.value.param == "top_p"


async def test_failure_after_the_stream_started_is_in_band(start_gateway, start_mock_core):
    """The core goes away mid-stream: an `error` event, then `response.failed`."""
    doomed = await start_mock_core(mock_step_ms=20)
    try:
        url = await start_gateway("openai", core=doomed.address)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            stream = await client.responses.create(model="mock", input="Hi", max_output_tokens=1000, stream=True)
            first = await stream.__anext__()
            assert first.type == "response.created"
            await doomed.stop(0)
            events = [event async for event in stream]
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        error, failed = events[-2:]
        assert error.message and failed.response.status == "failed"
        assert failed.response.error.code == "server_error"
        assert failed.response.error.message == error.message
    finally:
        await doomed.stop(0)
