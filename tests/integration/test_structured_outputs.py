"""Structured outputs and tool calls end to end: the official `openai` SDK against the OpenAI
gateway, the LMI gateway (chat on /invocations and TGI's `grammar`), the Triton gateway's guided
parameters, all over the shared in-process core (HF engine on the tiny untrained model).

The tiny model writes nonsense, so every schema here bounds its output (enums, maxLength, number
ranges, maxItems): the guide then always completes well within max_tokens and ends on EOS.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

MODEL = "tiny"
HI = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Reading(BaseModel):
    """What `chat.completions.parse` gets back (pydantic's schema with bounds)."""

    place: str = Field(max_length=6)
    celsius: int = Field(ge=-40, le=50)
    sunny: bool
    wind: Literal["none", "light", "strong"]


async def test_parse_with_a_pydantic_model_returns_the_parsed_object(aclient):
    for seed in range(3):
        completion = await aclient.chat.completions.parse(
            model=MODEL, messages=HI, response_format=Reading, max_tokens=80, seed=seed, temperature=1.0
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Reading)
        assert Reading.model_validate_json(message.content) == message.parsed


async def test_json_object_mode_returns_a_json_object(aclient):
    completion = await aclient.chat.completions.create(
        model=MODEL, messages=HI, response_format={"type": "json_object"}, max_tokens=60, seed=3
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an open-ended object may run to max_tokens; what came is still a JSON object's start
        assert choice.message.content.startswith("{")


async def test_an_invalid_schema_is_a_400_naming_the_parameter(aclient):
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(
            model=MODEL,
            messages=HI,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}},
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == "response_format"
    assert "does not compile" in err.value.body["message"]


async def test_an_invalid_tool_schema_is_named_as_the_tools(aclient):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(model=MODEL, messages=HI, tools=[bad], tool_choice="required")
    assert err.value.body["param"] == "tools"


async def test_tool_choice_required_always_yields_a_call(aclient):
    for seed in range(6):
        completion = await aclient.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            seed=seed,
            temperature=1.0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


async def test_streaming_tool_calls_reassemble_into_valid_json(aclient):
    for choice_of_tool in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=[WEATHER, TIME],
            tool_choice=choice_of_tool,
            max_tokens=80,
            seed=2,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                    entry["id"] = entry["id"] or delta.id
                    entry["name"] = entry["name"] or delta.function.name
                    entry["arguments"] += delta.function.arguments or ""
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and calls
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            tool = {"get_weather": WEATHER, "get_time": TIME}[entry["name"]]
            jsonschema.validate(json.loads(entry["arguments"]), tool["function"]["parameters"])


async def test_the_sdk_accumulates_streamed_tool_calls(aclient):
    """The SDK's own stream helper (`chat.completions.stream`) rebuilds the final message."""
    async with aclient.chat.completions.stream(
        model=MODEL,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        seed=5,
    ) as stream:
        final = await stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


async def test_tool_calls_and_tool_results_go_back_through_the_template(aclient, stub):
    """An assistant turn's tool_calls and the tool's answer reach the chat template (the tiny
    model's renders calls Hermes-style and results as a <|tool|> turn)."""
    from trellis.generate.v1 import generate_pb2 as pb
    from trellis.generate.v1 import generate_service_pb2 as spb

    messages = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="user", content=[pb.ContentPart(text="Weather?")]),
            pb.ChatMessage(
                role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')]
            ),
            pb.ChatMessage(role="tool", tool_call_id="c1", content=[pb.ContentPart(text="3 C")]),
        ],
        tools=[pb.Tool(name="get_weather", parameters='{"type": "object"}')],
    )
    rendered = (await stub.Tokenize(spb.TokenizeRequest(messages=messages))).rendered_prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rendered
    assert rendered.endswith("<|tool|>3 C<|end|><|assistant|>")
    completion = await aclient.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
        ],
        tools=[WEATHER],
        max_tokens=4,
    )
    assert completion.usage.prompt_tokens > len(rendered) // 8  # the whole rendered conversation was sent


# ------------------------------------------------------------------------------------- LMI


@pytest_asyncio.fixture(scope="module")
async def lmi_url(start_gateway) -> str:
    return await start_gateway("lmi")


async def test_lmi_tgi_grammar_constrains_the_output(lmi_url):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    async with aiohttp.ClientSession() as http:
        for grammar, check in [
            ({"type": "json", "value": schema}, lambda text: jsonschema.validate(json.loads(text), schema)),
            ({"type": "regex", "value": "[a-c]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-c]{3}-[0-9]{2}", text)),
        ]:
            body = {"inputs": "Say", "parameters": {"grammar": grammar, "max_new_tokens": 30, "details": True}}
            async with http.post(f"{lmi_url}/invocations", json=body) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert out["details"]["finish_reason"] == "eos_token"
            assert check(out["generated_text"]) is not False
        body = {"inputs": "Say", "parameters": {"grammar": {"type": "regex", "value": "[a-"}}}
        async with http.post(f"{lmi_url}/invocations", json=body) as resp:
            assert resp.status == 400
            assert "parameters.grammar" in (await resp.json())["error"]


async def test_lmi_chat_on_invocations_returns_tool_calls(lmi_url):
    body = {"messages": HI, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60, "seed": 5}
    async with aiohttp.ClientSession() as http, http.post(f"{lmi_url}/invocations", json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"][:1]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


# ------------------------------------------------------------------------------------- Triton


@pytest_asyncio.fixture(scope="module")
async def triton_url(start_gateway) -> str:
    return await start_gateway("triton")


async def test_triton_guided_parameters_constrain_the_output(triton_url):
    async with aiohttp.ClientSession() as http:
        for params, check in [
            ({"guided_choice": ["north", "south"]}, lambda text: text in ("north", "south")),
            ({"guided_regex": "[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{4}", text)),
            (
                {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "x" [a-b]'},
                lambda t: re.fullmatch("x[ab]", t),
            ),
        ]:
            body = {"text_input": "Where?", "parameters": {**params, "max_tokens": 20}}
            async with http.post(f"{triton_url}/v2/models/{MODEL}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            assert check(out["text_output"]), out
            assert out["finish_reason"] == "stop"
        body = {"text_input": "x", "parameters": {"guided_json": '{"type": "nope"}'}}
        async with http.post(f"{triton_url}/v2/models/{MODEL}/generate", json=body) as resp:
            assert resp.status == 400
            assert "guided_json" in (await resp.json())["error"]


async def test_guided_requests_share_a_batch_with_free_ones(aclient):
    """Constrained and unconstrained requests at once: each keeps its own constraint."""
    free = aclient.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, seed=1)
    parsed = aclient.chat.completions.parse(model=MODEL, messages=HI, response_format=Reading, max_tokens=80, seed=1)
    free_out, parsed_out = await asyncio.gather(free, parsed)
    assert isinstance(parsed_out.choices[0].message.parsed, Reading)
    assert free_out.choices[0].message.content is not None


async def test_the_mock_engine_lists_no_guide_kinds(mock_core):
    """The mock engine draws tokens without a model; it honours no guide, and says so."""
    import grpc
    from trellis.generate.v1 import generate_pb2 as pb
    from trellis.generate.v1 import generate_service_pb2 as spb
    from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        assert list((await stub.GetModelInfo(spb.GetModelInfoRequest())).guided_decoding) == []
        call = stub.Generate(spb.GenerateRequest(text="x", guided_decoding=pb.GuidedDecoding(regex="a")))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "mock engine does not support guided decoding" in err.value.details()
