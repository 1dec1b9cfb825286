"""Reasoning on chat completions (`--reasoning-parser qwen3`), with the official `openai` SDK
against a gateway on a mock core whose scripted replies hold `<think>` blocks split over several
tokens (conftest SCRIPT): `message.reasoning` and `delta.reasoning` (vLLM's field), reasoning
before a tool call, reasoning fields of input messages, and no reasoning field without a parser."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest_asyncio

THINK = [{"role": "user", "content": "Think first"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest_asyncio.fixture
async def scripted(scripted_url):
    client = openai.AsyncOpenAI(base_url=f"{scripted_url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def test_message_reasoning(scripted):
    resp = await scripted.chat.completions.create(model="mock", messages=THINK, max_tokens=100)
    message = resp.choices[0].message
    assert message.reasoning == "Two and two\nmake four."
    assert message.content == "The answer is 4." and resp.choices[0].finish_reason == "stop"
    plain = await scripted.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "Say hi"}], max_tokens=100
    )
    assert plain.choices[0].message.reasoning is None and plain.choices[0].message.content == "Hello there."


async def test_delta_reasoning_streams_without_tag_pieces(scripted):
    stream = await scripted.chat.completions.create(model="mock", messages=THINK, max_tokens=100, stream=True)
    reasoning, content = [], []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning", None):
            reasoning.append(delta.reasoning)
        if delta.content:
            content.append(delta.content)
    assert len(reasoning) > 1 and "".join(reasoning) == "Two and two\nmake four."
    assert not any(set(piece) & set("<>") for piece in reasoning)
    assert "".join(content) == "The answer is 4."


def step_outputs(core) -> int:
    """Engine outputs the core sent as plain decode steps (MultiplexGenerate `steps`)."""
    return core.servicer.pipeline.metrics.step_outputs


async def test_a_streamed_reply_with_reasoning_takes_steps_and_says_what_a_whole_one_says(
    scripted, scripted_url, scripted_core
):
    """The reasoning parser keeps the stream on plain decode steps (split as whole messages
    are), on chat completions, Responses and Anthropic Messages alike."""
    whole = (await scripted.chat.completions.create(model="mock", messages=THINK, max_tokens=100)).choices[0]
    before = step_outputs(scripted_core)
    stream = await scripted.chat.completions.create(model="mock", messages=THINK, max_tokens=100, stream=True)
    chunks = [chunk async for chunk in stream]
    assert step_outputs(scripted_core) > before
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == whole.message.reasoning
    assert "".join(d.content or "" for d in deltas) == whole.message.content

    before = step_outputs(scripted_core)
    events = [e async for e in await scripted.responses.create(model="mock", input="Think first", stream=True)]
    assert step_outputs(scripted_core) > before
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == whole.message.reasoning and done.output_text == whole.message.content

    before = step_outputs(scripted_core)
    body = {"model": "mock", "max_tokens": 100, "stream": True, "messages": THINK}
    async with aiohttp.ClientSession() as http, http.post(f"{scripted_url}/v1/messages", json=body) as resp:
        raw = (await resp.read()).decode()
    assert step_outputs(scripted_core) > before
    data = [json.loads(line[len("data: ") :]) for line in raw.splitlines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in data if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == whole.message.reasoning
    assert "".join(d.get("text", "") for d in deltas) == whole.message.content


async def test_reasoning_then_a_tool_call(scripted):
    ask = [{"role": "user", "content": "Think, then call"}]
    resp = await scripted.chat.completions.create(model="mock", messages=ask, max_tokens=100, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.message.reasoning == "I need the weather." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    stream = await scripted.chat.completions.create(
        model="mock", messages=ask, max_tokens=100, tools=[WEATHER], stream=True
    )
    reasoning, arguments = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
    assert reasoning == "I need the weather." and json.loads(arguments) == {"city": "Rome"}


async def test_input_reasoning_is_accepted_and_left_out_of_the_prompt(scripted):
    turns = [
        {"role": "user", "content": "Say hi"},
        {
            "role": "assistant",
            "content": "Hello there.",
            "reasoning": "Think first",
            "reasoning_content": "Think first",
        },
        {"role": "user", "content": "Again"},
    ]
    resp = await scripted.chat.completions.create(model="mock", messages=turns, max_tokens=100)
    # "Say hi" matched, not "Think first": the reasoning of the earlier turn was not rendered.
    assert resp.choices[0].message.content == "Hello there."


async def test_no_reasoning_field_without_a_parser(aclient):
    resp = await aclient.chat.completions.create(model="tiny", messages=THINK, max_tokens=3)
    assert "reasoning" not in (resp.choices[0].message.model_extra or {})
