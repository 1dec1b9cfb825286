"""The OpenAI gateway's defaults for clients that expect OpenAI's or vLLM's: max_tokens left out
is the rest of the context (`--default-max-tokens`), the core's `--served-model-name` aliases,
and `--accept-any-model` (TGI's behaviour), with the openai SDK on real gateways in front of
mock-engine cores on loopback."""

from __future__ import annotations

import aiohttp
import openai
import pytest
import pytest_asyncio

USER = [{"role": "user", "content": "hi"}]
CONTEXT = 64


@pytest_asyncio.fixture(scope="module")
async def small_core(start_mock_core):
    """A mock core with a 64-token context, named 'mock' and also 'gpt-4o-mini'."""
    return await start_mock_core(mock_context_length=CONTEXT, served_model_name_list=("mock", "gpt-4o-mini"))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_max_tokens_left_out_is_the_rest_of_the_context(start_gateway, small_core):
    url = await start_gateway("openai", core=small_core.address, default_max_tokens="context")
    async with client(url) as c:
        resp = await c.chat.completions.create(model="mock", messages=USER)
        assert resp.usage.prompt_tokens + resp.usage.completion_tokens == CONTEXT
        assert resp.choices[0].finish_reason == "length"
        capped = await c.chat.completions.create(model="mock", messages=USER, max_tokens=3)
        assert capped.usage.completion_tokens == 3
    core_default = await start_gateway("openai", core=small_core.address, default_max_tokens="core")
    async with client(core_default) as c:
        resp = await c.chat.completions.create(model="mock", messages=USER)
        assert resp.usage.completion_tokens == 30  # the core's --default-max-new-tokens


async def test_served_model_name_aliases(start_gateway, small_core):
    url = await start_gateway("openai", core=small_core.address)
    async with client(url) as c:
        resp = await c.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=2)
        assert resp.model == "mock"
        listed = await c.models.list()
        assert [m.id for m in listed.data] == ["mock", "gpt-4o-mini"]
        assert (await c.models.retrieve("gpt-4o-mini")).id == "gpt-4o-mini"
        with pytest.raises(openai.NotFoundError) as info:
            await c.completions.create(model="placeholder", prompt="x", max_tokens=2)
        assert info.value.param == "model"
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("placeholder")


async def test_accept_any_model(start_gateway, small_core):
    url = await start_gateway("openai", core=small_core.address, accept_any_model=True)
    async with client(url) as c:
        chat = await c.chat.completions.create(model="tgi", messages=USER, max_tokens=2)
        text = await c.completions.create(model="whatever", prompt="x", max_tokens=2)
        assert chat.model == text.model == "mock"
        assert (await c.models.retrieve("tgi")).id == "mock"


async def test_lmi_tgi_routes_accept_any_model(start_gateway, small_core):
    strict = await start_gateway("lmi", core=small_core.address)
    lenient = await start_gateway("lmi", core=small_core.address, accept_any_model=True)
    body = {"model": "tgi", "messages": USER, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{strict}/v1/chat/completions", json=body) as r:
            assert r.status == 404
        async with s.post(f"{lenient}/v1/chat/completions", json=body) as r:
            assert r.status == 200 and (await r.json())["model"] == "mock"
