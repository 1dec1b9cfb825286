"""The OpenAI Agents SDK (`openai-agents`) against the OpenAI gateway's Responses API: an Agent
with one function tool and an output type, through `OpenAIResponsesModel`, run whole and
streamed, with the conversation sent as items and chained by `previous_response_id`.

`openai-agents` is a dev dependency (pyproject.toml; it is why websockets is pinned below 17),
so `make test` runs this module.

The untrained test model never ends free text by itself (a response would be `incomplete`,
which the Agents SDK treats as a failure), so the agent has an output type with a bounded
schema: its last turn is guided JSON that ends on EOS. The first turn must call the tool
(`tool_choice="required"`, reset by the SDK after the call), whose argument is an enum.
"""

from __future__ import annotations

from typing import Literal

import agents
import openai
import pytest
from agents.models.openai_responses import OpenAIResponsesModel
from pydantic import BaseModel, Field

MODEL = "tiny"


class Reading(BaseModel):
    """The agent's output type (a bounded schema)."""

    place: Literal["Oslo", "Rome"]
    celsius: int = Field(ge=-40, le=50)


def weather_agent(client: openai.AsyncOpenAI, calls: list[str]):
    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Rome"]) -> str:
        """Current weather of a city."""
        calls.append(city)
        return "3 C and windy"

    settings = agents.ModelSettings(tool_choice="required", max_tokens=80, parallel_tool_calls=False)
    return agents.Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=settings,
        output_type=Reading,
    )


@pytest.mark.parametrize("chained", [False, True])
async def test_an_agent_calls_its_tool_and_answers(base_url, chained):
    agents.set_tracing_disabled(True)
    calls: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        agent = weather_agent(client, calls)
        result = await agents.Runner.run(agent, "Weather in Oslo?", max_turns=4, auto_previous_response_id=chained)
        assert len(calls) == 1 and isinstance(result.final_output, Reading)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        if chained:
            last = result.raw_responses[-1].response_id
            assert (await client.responses.retrieve(last)).previous_response_id == result.raw_responses[0].response_id


async def test_a_streamed_agent_run(base_url):
    agents.set_tracing_disabled(True)
    calls: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        streamed = agents.Runner.run_streamed(weather_agent(client, calls), "Weather in Oslo?", max_turns=4)
        kinds = {event.type async for event in streamed.stream_events()}
    assert len(calls) == 1 and isinstance(streamed.final_output, Reading)
    assert {"raw_response_event", "run_item_stream_event"} <= kinds
