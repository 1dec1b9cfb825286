"""LoRA adapter affinity over three cores (`--routing prefix`): every request for one adapter
reaches one core, whether the adapter is named by OpenAI's `model` or by LMI's `adapters`
field (`GenerateRequest.adapter`); six adapters settle two per core of two slots; the base
model's requests keep routing by prefix; round robin spreads an adapter over the cores.

The cores run the mock engine with six adapters each and `--max-loras 2`; which core served an
adapter's requests is read from each core's per-adapter counter (the source of
`trellis_core_lora_requests_total`).
"""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest

from tests.lora_helpers import make_adapter

ADAPTERS = tuple(f"ft-{i}" for i in range(6))


@pytest.fixture(scope="module")
def lora_modules(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-adapters")
    return tuple((name, str(make_adapter(root / name, tiny_model_dir, seed=i))) for i, name in enumerate(ADAPTERS))


async def three_cores(start_mock_core, lora_modules):
    return [await start_mock_core(lora_modules=lora_modules, max_loras=2) for _ in range(3)]


def served(cores, adapter: str) -> list[int]:
    """Ended requests of `adapter` per core."""
    return [c.servicer.pipeline.metrics.adapter_requests.get(adapter, 0) for c in cores]


async def complete(http: aiohttp.ClientSession, url: str, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 3}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["model"] == model


async def test_each_adapter_s_requests_meet_on_one_core(start_mock_core, start_gateway, lora_modules):
    cores = await three_cores(start_mock_core, lora_modules)
    addresses = ",".join(c.address for c in cores)
    url = await start_gateway("openai", core=addresses, routing="prefix")
    lmi = await start_gateway("lmi", core=addresses, routing="prefix")
    async with aiohttp.ClientSession() as http:
        for name in ADAPTERS:
            for i in range(4):  # different prompts: one key, the adapter's
                await complete(http, url, name, f"Question {i} about {name}?")
        homes = []
        for name in ADAPTERS:
            counts = served(cores, name)
            assert sorted(counts) == [0, 0, 4], (name, counts)
            homes.append(counts.index(4))
        # Each core holds two adapters (--max-loras 2): an adapter whose ring cores are full
        # goes to one with a free slot.
        assert sorted(collections.Counter(homes).values()) == [2, 2, 2], homes
        # LMI names the adapter in GenerateRequest.adapter: the same key, the same core.
        for i in range(2):
            body = {"inputs": f"Other words {i}", "parameters": {"max_new_tokens": 3}, "adapters": ADAPTERS[0]}
            async with http.post(lmi + "/invocations", json=body) as r:
                assert r.status == 200, await r.text()
        assert served(cores, ADAPTERS[0])[homes[0]] == 6
        # The base model's requests route by their prefix, not all to one core.
        before = [sum(c.servicer.pipeline.metrics.requests.values()) for c in cores]
        for topic in ("ships", "trains", "bees", "tides", "salt", "maps", "glass", "owls", "clay"):
            await complete(http, url, "mock", f"Tell me about {topic}.")
        after = [sum(c.servicer.pipeline.metrics.requests.values()) for c in cores]
        assert sum(1 for b, a in zip(before, after, strict=True) if a > b) > 1, (before, after)


async def test_round_robin_spreads_an_adapter(start_mock_core, start_gateway, lora_modules):
    cores = await three_cores(start_mock_core, lora_modules)
    url = await start_gateway("openai", core=",".join(c.address for c in cores), routing="round_robin")
    async with aiohttp.ClientSession() as http:
        for i in range(3):  # let the pool open a stream per core
            await complete(http, url, "mock", f"warm-up {i}")
        await asyncio.sleep(1.2)  # the streams opened while connecting expire (PROVISIONAL_AGE)
        for i in range(12):
            await complete(http, url, ADAPTERS[0], f"Question {i}?")
    counts = served(cores, ADAPTERS[0])
    assert sum(counts) == 12 and sum(1 for n in counts if n) > 1, counts
