"""Anthropic's Messages API on the OpenAI gateway, with the official `anthropic` SDK unmodified
against real gateways and cores on loopback: messages.create, messages.stream (text_stream and
the final message), a tool_use -> tool_result round trip, count_tokens, thinking blocks, errors
(before and inside a stream), and API keys sent as `x-api-key`. Every streamed event read raw is
parsed with the SDK's own event models.

Two cores: the shared HF core on the untrained tiny model (guided decoding, so a forced tool
call is valid JSON), and a mock core whose replies are scripted by prompt (`--mock-script`),
which gives reasoning tags and Hermes tool calls split over several tokens, as a model writes
them.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import anthropic
import jsonschema
import pytest
import pytest_asyncio
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

MODEL = "tiny"
HI = [{"role": "user", "content": "Tell me about gardens."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
EVENT = TypeAdapter(RawMessageStreamEvent)
# The SDK 2.10.0 no longer types temperature, top_p and top_k (the API still takes them).
GREEDY = {"temperature": 0}


def sdk(url: str, **kwargs) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


@pytest_asyncio.fixture
async def client(base_url):
    c = sdk(base_url)
    yield c
    await c.close()


@pytest_asyncio.fixture
async def scripted(scripted_url):
    c = sdk(scripted_url)
    yield c
    await c.close()


async def raw_events(url: str, body: dict, headers: dict | None = None) -> list:
    """POST a streamed Messages body and parse each SSE event with the SDK's event models
    (RawMessageStreamEvent's union, ErrorResponse), checking that each `event:` name is its
    data's `type`."""
    events = []
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/messages", json=body, headers=headers) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        text = await r.text()
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        if name == "ping":  # the SDK skips pings (anthropic/_streaming.py): no model for them
            assert data == {"type": "ping"}
            events.append(SimpleNamespace(type="ping"))
        else:
            events.append(ErrorResponse.model_validate(data) if name == "error" else EVENT.validate_python(data))
    return events


def check_event_order(events) -> None:
    """message_start, ping, then blocks opened, fed and closed in index order, message_delta,
    message_stop."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    open_index = None
    next_index = 0
    for e in events[2:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index
            open_index, next_index = e.index, next_index + 1
        elif e.type == "content_block_delta":
            assert e.index == open_index
        else:
            assert e.type == "content_block_stop" and e.index == open_index
            open_index = None
    assert open_index is None


# --------------------------------------------------------------------------- create


async def test_create_returns_a_message(client):
    msg = await client.messages.create(model=MODEL, max_tokens=5, messages=HI, system="Be brief.", extra_body=GREEDY)
    assert isinstance(msg, Message)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.stop_sequence is None
    assert [b.type for b in msg.content] in (["text"], [])
    assert 0 < msg.usage.output_tokens <= 5
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0
    again = await client.messages.create(model=MODEL, max_tokens=5, messages=HI, system="Be brief.", extra_body=GREEDY)
    assert again.content == msg.content  # greedy: the same text


async def test_scripted_reply_ends_the_turn(scripted):
    msg = await scripted.messages.create(
        model="mock", max_tokens=50, messages=[{"role": "user", "content": "Say hi"}], metadata={"user_id": "u1"}
    )
    assert msg.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello there.")]


async def test_stop_sequences(scripted):
    msg = await scripted.messages.create(
        model="mock", max_tokens=50, messages=[{"role": "user", "content": "Count on"}], stop_sequences=["STOP", "X"]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].text == "one two "


async def test_top_k_and_top_p_reach_the_core(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(model=MODEL, max_tokens=2, messages=HI, extra_body={"top_k": -1})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("top_k")
    msg = await client.messages.create(model=MODEL, max_tokens=2, messages=HI, extra_body={"top_k": 5, "top_p": 0.9})
    assert msg.usage.output_tokens <= 2


# --------------------------------------------------------------------------- streaming


async def test_stream_text_and_final_message(client):
    async with client.messages.stream(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert final.content[0].text == text if final.content else text == ""
    whole = await client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY)
    assert [b.text for b in whole.content] == [b.text for b in final.content]
    assert whole.stop_reason == final.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_raw_stream_events_parse_with_the_sdk_models(base_url):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True}
    events = await raw_events(base_url, body, {"anthropic-version": "2023-06-01"})
    check_event_order(events)
    start, delta = events[0], events[-2]
    assert start.message.id.startswith("msg_") and start.message.content == []
    assert delta.delta.stop_reason in ("max_tokens", "end_turn")
    assert delta.usage.output_tokens <= 4 and delta.usage.input_tokens > 0


async def test_thinking_blocks_from_tags_split_across_tokens(scripted, scripted_url, tokenizer):
    assert len(tokenizer.encode("<think>", add_special_tokens=False)) > 1  # the tag comes in pieces
    ask = [{"role": "user", "content": "Think first"}]
    msg = await scripted.messages.create(model="mock", max_tokens=100, messages=ask)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Two and two\nmake four." and msg.content[1].text == "The answer is 4."
    events = await raw_events(scripted_url, {"model": "mock", "max_tokens": 100, "messages": ask, "stream": True})
    check_event_order(events)
    block0 = [e.delta for e in events if e.type == "content_block_delta" and e.index == 0]
    assert block0[-1].type == "signature_delta" and block0[-1].signature == ""  # as Anthropic ends a thinking block
    thinking = [d.thinking for d in block0[:-1]]
    assert len(thinking) > 1 and "".join(thinking) == "Two and two\nmake four."
    assert all("<" not in piece and ">" not in piece for piece in thinking)
    async with scripted.messages.stream(model="mock", max_tokens=100, messages=ask) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "The answer is 4."
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


# --------------------------------------------------------------------------- tools


async def test_tool_use_then_tool_result_round_trip(scripted, scripted_url):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    msg = await scripted.messages.create(model="mock", max_tokens=100, messages=ask, tools=[WEATHER])
    assert msg.stop_reason == "tool_use"
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert call.id.startswith("toolu_")
    events = await raw_events(
        scripted_url, {"model": "mock", "max_tokens": 100, "messages": ask, "tools": [WEATHER], "stream": True}
    )
    check_event_order(events)
    assert events[2].content_block.type == "tool_use" and events[2].content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == {"city": "Oslo"} and events[-2].delta.stop_reason == "tool_use"
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "It is 3 C"}]},
    ]
    answer = await scripted.messages.create(model="mock", max_tokens=100, messages=turn, tools=[WEATHER])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is cold in Oslo: 3 C."


async def test_forced_tool_streams_valid_json(client):
    choice = {"type": "tool", "name": "get_weather"}
    async with client.messages.stream(
        model=MODEL, max_tokens=40, messages=HI, tools=[WEATHER], tool_choice=choice
    ) as stream:
        final = await stream.get_final_message()
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    if final.stop_reason == "tool_use":  # the schema closed the object within max_tokens
        jsonschema.validate(call.input, WEATHER["input_schema"])
    any_call = await client.messages.create(
        model=MODEL, max_tokens=60, messages=HI, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert any_call.content and all(b.type == "tool_use" for b in any_call.content)
    none = await client.messages.create(
        model=MODEL, max_tokens=3, messages=HI, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert all(b.type == "text" for b in none.content)


# --------------------------------------------------------------------------- count_tokens


async def test_count_tokens_is_the_prompt_generate_sees(client):
    prompt = [{"role": "user", "content": "Count the tokens of this unique prompt, 7361."}]
    counted = await client.messages.count_tokens(model=MODEL, messages=prompt, system="Be brief.")
    assert isinstance(counted, MessageTokensCount) and counted.input_tokens > 0
    msg = await client.messages.create(model=MODEL, max_tokens=1, messages=prompt, system="Be brief.")
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    with_tools = await client.messages.count_tokens(model=MODEL, messages=prompt, system="Be brief.", tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.count_tokens(model="claude-x", messages=prompt)
    assert err.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as err:  # the core's Tokenize refuses it: a text-only model
        await client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [image]}])
    assert err.value.body["error"]["message"].startswith("messages.0.content: This model accepts text only")


# --------------------------------------------------------------------------- errors


async def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/messages", json=body, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("body", "starts"),
    [
        ({"model": MODEL, "messages": HI}, "max_tokens: Field required"),
        ({"model": MODEL, "messages": HI, "max_tokens": 5, "frequency_penalty": 1}, "frequency_penalty: Extra inputs"),
        ({"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 1.5}, "temperature: Input should be less"),
        ({"model": MODEL, "messages": HI, "max_tokens": 0}, "max_tokens: Input should be greater"),
        (
            {"model": MODEL, "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}},
            "thinking: not supported",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0: 'document' blocks are not supported",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "w"}]},
            "tools.0: server tools",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": HI,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "x"},
            },
            "tool_choice.name: no tool named 'x'",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": "Sure"}]},
            "messages: a final assistant message",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *HI],
            },
            "messages.0.content.0: 'tool_result' blocks are not allowed",
        ),
        ([1, 2], "The request body must be a JSON object."),
    ],
)
async def test_bad_requests_are_anthropic_errors(base_url, body, starts):
    status, error = await post(base_url, body)
    assert status == 400
    parsed = ErrorResponse.model_validate(error)
    assert parsed.type == "error" and parsed.error.type == "invalid_request_error"
    assert parsed.error.message.startswith(starts), parsed.error.message
    assert error["request_id"].startswith("msg_") or body == [1, 2]


async def test_sdk_errors(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"bogus": 1})
    assert err.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "bogus: Extra inputs are not permitted",
    }
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.create(model="claude-x", max_tokens=5, messages=HI)
    assert err.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:  # the tiny model takes no images
        await client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"


async def test_http_level_errors_are_anthropic_shaped(base_url):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base_url}/v1/messages", data=b"{", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert ErrorResponse.model_validate(await r.json()).error.type == "invalid_request_error"
        async with s.post(f"{base_url}/v1/messages", data=b"x", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 415 and (await r.json())["type"] == "error"
        async with s.get(f"{base_url}/v1/messages") as r:
            assert r.status == 405 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(f"{base_url}/v1/messages/nothing", json={}) as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
        async with s.post(f"{base_url}/v1/chat/nothing", json={}) as r:  # OpenAI's shape elsewhere
            assert r.status == 404 and "type" in (await r.json())["error"] and "request_id" not in await r.json()


async def test_x_api_key(start_gateway):
    url = await start_gateway("openai", api_key=("k-right",))
    good = sdk(url, api_key="k-right")
    bad = sdk(url, api_key="k-wrong")
    try:
        msg = await good.messages.create(model=MODEL, max_tokens=1, messages=HI)
        assert msg.usage.output_tokens == 1
        assert (await good.messages.count_tokens(model=MODEL, messages=HI)).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as err:
            await bad.messages.create(model=MODEL, max_tokens=1, messages=HI)
        assert err.value.body["error"] == {"type": "authentication_error", "message": "Invalid API key."}
    finally:
        await good.close()
        await bad.close()
    status, body = await post(url, {"model": MODEL, "max_tokens": 1, "messages": HI})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, _ = await post(url, {"model": MODEL, "max_tokens": 1, "messages": HI}, {"Authorization": "Bearer k-right"})
    assert status == 200


async def test_an_error_after_the_stream_started_is_an_error_event(start_mock_core, start_gateway):
    core = await start_mock_core(mock_step_ms=20.0)
    url = await start_gateway("openai", core=core.address)
    body = {"model": "mock", "max_tokens": 200, "messages": HI, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/messages", json=body) as r:
        assert r.status == 200
        await r.content.readuntil(b"content_block_delta")
        await core.stop(0)
        text = (await r.read()).decode()
    last = text.strip().split("\n\n")[-1]
    name, data = last.split("\n")
    assert name == "event: error"
    error = ErrorResponse.model_validate(json.loads(data.removeprefix("data: ")))
    assert error.error.type in ("overloaded_error", "api_error")
