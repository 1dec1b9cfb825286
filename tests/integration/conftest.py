"""Fixtures of the OpenAI gateway's test modules: a module's OpenAI gateway on the shared core
(`base_url`) and the openai SDK's async client on it (`aclient`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest_asyncio


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
