"""Fixtures of the OpenAI gateway's test modules: a module's OpenAI gateway on the shared core
(`base_url`), the openai SDK's async client on it (`aclient`), and an OpenAI gateway with
`--reasoning-parser qwen3` on a mock core whose replies are scripted by prompt (`scripted_url`
on `scripted_core`, SCRIPT), for what the gateway reads out of a model's text (reasoning, tool calls)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest_asyncio

from core.server import CoreServer


@pytest_asyncio.fixture(scope="module")
async def base_url(start_gateway) -> str:
    """An OpenAI gateway in front of the shared core (model 'tiny'), for this module."""
    return await start_gateway("openai")


@pytest_asyncio.fixture
async def aclient(base_url) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai SDK's async client on `base_url` (no retries: a test sees every answer)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


#: Scripted replies of the mock core behind `scripted_url` (core.engine.mock, `--mock-script`):
#: the first entry whose `when` is in the prompt wins. The tiny tokenizer splits the tags.
SCRIPT = [
    {"when": "It is 3 C", "reply": "It is cold in Oslo: 3 C."},
    {
        "when": "Weather in Oslo?",
        "reply": '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    },
    {
        "when": "Think, then call",
        "reply": '<think>I need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "</tool_call>",
    },
    {"when": "Think first", "reply": "<think>Two and two\nmake four.</think>The answer is 4."},
    {"when": "Count on", "reply": "one two STOP three"},
    {"when": "Say hi", "reply": "Hello there."},
]


@pytest_asyncio.fixture(scope="module")
async def scripted_core(start_mock_core, tmp_path_factory) -> CoreServer:
    """A mock core (model 'mock') answering SCRIPT, for this module."""
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return await start_mock_core(mock_script=str(path))


@pytest_asyncio.fixture(scope="module")
async def scripted_url(scripted_core, start_gateway) -> str:
    """An OpenAI gateway with --reasoning-parser qwen3 on `scripted_core`."""
    return await start_gateway("openai", core=scripted_core.address, reasoning_parser="qwen3")
