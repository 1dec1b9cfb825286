"""Batch invariance of the HF engine: a greedy request gives the same tokens
whatever else is in the batch, on the engine thread (`--no-engine-process`) and in an engine
process. Each test forces one schedule: prompts of different lengths prefilled together (they
join the batch longest first, so their slots are not in join order), a request that takes a
freed slot below a running one, and 32 identical requests in one batch. The tiny model is
untrained, so its logits lie close together and a row reading another row's logits or input
changes its argmax at once."""

from __future__ import annotations

import asyncio

import pytest

from core.engine import hf, hf_process
from core.sampling import resolve_generic
from core.types import EngineRequest, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle
from tests.unit.core.test_hf_engine import until_tokens

PROMPTS = [
    "Hello there, how are you today my friend?",
    "Hi",
    "The quick brown fox jumps over the lazy dog and then some more words",
]


@pytest.fixture(params=[False, True], ids=["thread", "process"])
async def engine(request, tiny_model_dir, tokenizer):
    e = hf_process.build(core_config(tiny_model_dir, engine_process=request.param, max_batch_size=40), tokenizer)
    await e.start()
    yield e
    await e.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def greedy(request_id: str, prompt: list[int], max_new_tokens: int = 24) -> EngineRequest:
    sampling = resolve_generic(SamplingOptions(), random_seed=1)
    return EngineRequest(request_id, prompt, sampling, max_new_tokens, ignore_eos=True)


async def tokens_of(outputs) -> list[int]:
    return [t async for out in outputs for s in out.sequences for t in s.token_ids]


async def alone(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens with nothing else in the batch."""
    out = [await tokens_of(engine.generate(greedy(f"alone-{i}", p))) for i, p in enumerate(prompts)]
    await wait_idle(engine)
    return out


async def test_prompts_of_different_lengths_prefilled_together(engine, prompts):
    expected = await alone(engine, prompts)
    if isinstance(engine, hf.HfEngine):
        with engine._cv:  # the worker sees all three at one step boundary: one prefill group
            streams = [engine.generate(greedy(f"group-{i}", p)) for i, p in enumerate(prompts)]
    else:  # sent back to back: the engine process admits them at the same boundary or close to it
        streams = [engine.generate(greedy(f"group-{i}", p)) for i, p in enumerate(prompts)]
    assert await asyncio.gather(*(tokens_of(s) for s in streams)) == expected


async def test_a_request_in_a_freed_slot_below_a_running_one(engine, prompts):
    expected = await alone(engine, prompts)
    for i, probe in enumerate(prompts):
        first = engine.generate(greedy(f"first-{i}", prompts[0], 900))  # slot 0
        await until_tokens(first)
        second = engine.generate(greedy(f"second-{i}", prompts[2], 900))  # slot 1
        await until_tokens(second)
        await first.aclose()  # frees slot 0 while slot 1 runs
        await wait_for(lambda: engine.stats().active == 1)
        assert await tokens_of(engine.generate(greedy(f"probe-{i}", probe))) == expected[i]  # slot 0
        await second.aclose()
        await wait_idle(engine)


async def test_thirty_two_identical_requests_in_one_batch(engine, prompts):
    expected = await alone(engine, prompts[:1])
    streams = [engine.generate(greedy(f"same-{k}", prompts[0])) for k in range(32)]
    assert await asyncio.gather(*(tokens_of(s) for s in streams)) == expected * 32
