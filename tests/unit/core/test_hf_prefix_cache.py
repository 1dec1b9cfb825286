"""Automatic prefix caching in the HF engine (core.engine.hf_prefix with core.engine.hf): a
prompt that starts with cached blocks computes only the rest, and gets the tokens and logprobs
it gets without the cache (greedy tokens equal, logprobs within 1e-5 in float32 on CPU): the
same prompt twice, a shared prefix with different suffixes, a prompt continuing a finished
sequence (its generated blocks), n > 1 with seeded sampling, guided decoding, a request joining
a running batch, two requests with the same new prefix in one step, prompt logprobs (they skip
the lookup), a cancelled request, eviction under a tiny bound, the off switch, and the counters,
on the engine thread and in an engine process."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from core.engine import hf, hf_process
from core.types import EngineRequest, Guide, PrefixCacheStats, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle
from tests.unit.core.test_hf_engine import until_tokens
from tests.unit.core.test_hf_fused_step import kinds, request

BLOCK = 16
SYSTEM = (
    "You are a careful assistant. Answer in one short paragraph, say when you do not know, "
    "and never invent a source. The user is a student of geography and history. "
)
QUESTIONS = ["What is the capital of France?", "Name three rivers of Europe.", "When did Rome fall?"]


@pytest.fixture
def trace(tmp_path) -> Path:
    return tmp_path / "steps.txt"


async def started(engine):
    await engine.start()
    return engine


@pytest.fixture
async def engine(tiny_model_dir, tokenizer, trace):
    e = await started(hf.build(core_config(tiny_model_dir, max_batch_size=24, hf_step_trace=str(trace)), tokenizer))
    yield e
    await e.shutdown()


@pytest.fixture
async def uncached(tiny_model_dir, tokenizer):
    e = await started(hf.build(core_config(tiny_model_dir, max_batch_size=24, prefix_cache=False), tokenizer))
    yield e
    await e.shutdown()


@pytest.fixture(scope="module")
def chats(tokenizer) -> list[list[int]]:
    """Prompts sharing a system prompt of several blocks, each with its own question."""
    return [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]


async def run(engine, r: EngineRequest) -> dict:
    """One request's tokens, logprobs and top alternatives per sequence, prompt logprobs, and
    the cached tokens its PREFILLED output reported."""
    result: dict = {"tokens": {}, "logprobs": {}, "tops": {}, "prompt": None, "cached": None}
    async for out in engine.generate(r):
        if out.prompt_logprobs is not None:
            result["prompt"] = out.prompt_logprobs
        if out.state is not None and out.state.name == "PREFILLED":
            result["cached"] = out.cached_tokens
        for s in out.sequences:
            result["tokens"].setdefault(s.index, []).extend(s.token_ids)
            result["logprobs"].setdefault(s.index, []).extend(s.logprobs or [])
            result["tops"].setdefault(s.index, []).extend(s.top_logprobs or [])
    return result


def greedy(request_id: str, prompt: list[int], max_new_tokens: int = 24, **fields) -> EngineRequest:
    return request(request_id, prompt, max_new_tokens, logprobs=True, top_logprobs=5, **fields)


def assert_same(got: dict, want: dict) -> None:
    """Equal tokens; logprobs and top alternatives within 1e-5."""
    assert got["tokens"] == want["tokens"]
    for i, lps in want["logprobs"].items():
        assert got["logprobs"][i] == pytest.approx(lps, abs=1e-5)
    for i, tops in want["tops"].items():
        for g, w in zip(got["tops"][i], tops, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-5)


def hit(prompt: list[int]) -> int:
    """Tokens a fully cached prompt reuses: its full blocks, leaving at least one token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


async def test_the_same_prompt_twice_computes_only_its_last_block(engine, uncached, chats, trace):
    prompt = chats[0]
    assert len(prompt) > 3 * BLOCK
    reference = await run(uncached, greedy("ref", prompt))
    first = await run(engine, greedy("first", prompt))
    second = await run(engine, greedy("second", prompt))
    assert (first["cached"], second["cached"]) == (0, hit(prompt))
    assert_same(first, reference)
    assert_same(second, reference)
    # The second prefill put only the uncached tokens in its forward.
    prefills = [line.split() for line in trace.read_text().splitlines() if line.startswith("prefill")]
    assert [int(p[2]) for p in prefills] == [len(prompt), len(prompt) - hit(prompt)]
    stats = engine.stats().prefix_cache
    assert stats is not None
    # The blocks of the prompt and of the generated tokens whose keys and values were computed.
    assert (stats.queries, stats.hits, stats.blocks) == (2 * len(prompt), hit(prompt), (len(prompt) + 23) // BLOCK)
    assert uncached.stats().prefix_cache is None and reference["cached"] == 0


async def test_a_shared_prefix_with_different_suffixes(engine, uncached, chats):
    common = next(i for i, (a, b) in enumerate(zip(chats[0], chats[1], strict=False)) if a != b)
    assert common >= 2 * BLOCK
    references = [await run(uncached, greedy(f"ref{i}", p)) for i, p in enumerate(chats)]
    results = [await run(engine, greedy(f"chat{i}", p)) for i, p in enumerate(chats)]
    assert results[0]["cached"] == 0
    for r in results[1:]:
        assert r["cached"] == common // BLOCK * BLOCK
    for got, want in zip(results, references, strict=True):
        assert_same(got, want)


async def test_a_prompt_continuing_a_finished_sequence_reuses_its_generated_blocks(engine, uncached, chats):
    """A session's or a chat's next turn sends the previous sequence back: the blocks of its
    generated tokens (all but the last, whose keys and values were never computed) are cached."""
    first = await run(engine, greedy("first", chats[0], 40))
    history = chats[0] + first["tokens"][0]
    follow = history + chats[1][-5:]
    reference = await run(uncached, greedy("ref", follow))
    got = await run(engine, greedy("follow", follow))
    assert got["cached"] == (len(history) - 1) // BLOCK * BLOCK > hit(chats[0])
    assert_same(got, reference)


async def test_n_sequences_with_seeded_sampling(engine, uncached, chats):
    sampling = SamplingOptions(do_sample=True, temperature=0.9, top_k=20)

    def make(tag: str) -> EngineRequest:
        return request(tag, chats[2], 16, sampling=sampling, seed=7, num_sequences=3, logprobs=True)

    reference = await run(uncached, make("ref"))
    first, second = await run(engine, make("first")), await run(engine, make("second"))
    assert second["cached"] == hit(chats[2]) and len(second["tokens"]) == 3
    assert_same(first, reference)
    assert_same(second, reference)


async def test_a_guided_request_on_a_cached_prefix(engine, uncached, chats, tokenizer):
    guide = Guide("regex", "[A-F]{2}-[0-9]{3}")
    reference = await run(uncached, request("ref", chats[0], 30, guide=guide, ignore_eos=False))
    await run(engine, greedy("warm", chats[0]))
    guided = await run(engine, request("guided", chats[0], 30, guide=guide, ignore_eos=False))
    assert guided["cached"] == hit(chats[0])
    assert guided["tokens"] == reference["tokens"]
    assert re.fullmatch("[A-F]{2}-[0-9]{3}", tokenizer.decode(guided["tokens"][0], skip_special_tokens=True))


async def test_a_cached_prompt_joining_a_running_batch(engine, uncached, chats, trace):
    references = [await run(uncached, greedy(f"ref{i}", p)) for i, p in enumerate(chats)]
    await run(engine, greedy("warm", chats[0]))
    long = engine.generate(request("long", chats[1][:10], 900))
    await until_tokens(long)
    joined = await asyncio.gather(*(run(engine, greedy(f"join{i}", p)) for i, p in enumerate(chats)))
    await long.aclose()
    await wait_idle(engine)
    assert "mixed" in kinds(trace)
    assert all(j["cached"] > 0 for j in joined)
    for got, want in zip(joined, references, strict=True):
        assert_same(got, want)


async def test_two_requests_with_the_same_new_prefix_in_one_step(engine, uncached, chats):
    reference = await run(uncached, greedy("ref", chats[0]))
    with engine._cv:  # the worker admits both at one step boundary
        streams = [engine.generate(greedy(f"twin{i}", chats[0])) for i in range(2)]

    async def drain(stream) -> dict:
        tokens: list[int] = []
        cached = None
        async for out in stream:
            if out.state is not None and out.state.name == "PREFILLED":
                cached = out.cached_tokens
            tokens += [t for s in out.sequences for t in s.token_ids]
        return {"tokens": tokens, "cached": cached}

    twins = await asyncio.gather(*(drain(s) for s in streams))
    assert [t["cached"] for t in twins] == [0, 0]  # the second cannot use what the first computes
    assert all(t["tokens"] == reference["tokens"][0] for t in twins)
    stats = engine.stats().prefix_cache
    assert stats is not None and stats.blocks == (len(chats[0]) + 23) // BLOCK  # stored once
    third = await run(engine, greedy("third", chats[0]))
    assert third["cached"] == hit(chats[0])
    assert_same(third, reference)


async def test_a_cached_prefix_does_not_count_against_the_prefill_budget(tiny_model_dir, tokenizer, chats, trace):
    """Two requests for a cached prompt fit one prefill step whose budget holds one whole prompt
    and both uncached tails (`--max-prefill-tokens`, as vLLM's token budget counts)."""
    prompt = chats[0]
    budget = len(prompt) + 2 * (len(prompt) - hit(prompt)) - 1  # not two whole prompts
    config = core_config(tiny_model_dir, max_batch_size=8, max_prefill_tokens=budget, hf_step_trace=str(trace))
    e = await started(hf.build(config, tokenizer))
    try:
        await run(e, greedy("first", prompt, 4))
        with e._cv:  # the worker sees both at one step boundary
            streams = [e.generate(greedy(f"twin{i}", prompt, 4)) for i in range(2)]
        for stream in streams:
            async for _ in stream:
                pass
    finally:
        await e.shutdown()
    prefills = [line.split() for line in trace.read_text().splitlines() if line.startswith("prefill")]
    # (rows, tokens computed): the first prompt whole, then both tails in one forward.
    assert [(int(p[1]), int(p[2])) for p in prefills] == [(1, len(prompt)), (2, 2 * (len(prompt) - hit(prompt)))]


async def test_prompt_logprobs_skip_the_lookup_but_fill_the_cache(engine, uncached, chats):
    reference = await run(uncached, greedy("ref", chats[1], prompt_logprobs=2))
    first = await run(engine, greedy("first", chats[1], prompt_logprobs=2))
    again = await run(engine, greedy("again", chats[1], prompt_logprobs=2))
    stats = engine.stats().prefix_cache
    assert stats is not None
    assert (first["cached"], again["cached"], stats.queries, stats.hits) == (0, 0, 0, 0)
    for got in (first, again):
        assert_same(got, reference)
        assert [p.token_id for p in got["prompt"]] == [p.token_id for p in reference["prompt"]]
        assert [p.logprob for p in got["prompt"][1:]] == pytest.approx(
            [p.logprob for p in reference["prompt"][1:]], abs=1e-5
        )
    plain = await run(engine, greedy("plain", chats[1]))  # the blocks they stored serve others
    assert plain["cached"] == hit(chats[1])
    assert_same(plain, reference)


async def test_a_cancelled_request_leaves_correct_blocks(engine, uncached, chats):
    reference = await run(uncached, greedy("ref", chats[2]))
    gone = engine.generate(greedy("gone", chats[2], 900))
    await until_tokens(gone)  # prefilled: its blocks are stored
    await gone.aclose()
    queued = engine.generate(greedy("queued", chats[0], 900))
    await queued.aclose()  # cancelled before or right after it was admitted
    await wait_idle(engine)
    after = await run(engine, greedy("after", chats[2]))
    assert after["cached"] == hit(chats[2])
    assert_same(after, reference)
    other = await run(engine, greedy("other", chats[0]))  # whatever "queued" left, the output holds
    assert_same(other, await run(uncached, greedy("ref0", chats[0])))


async def test_eviction_keeps_the_store_within_a_tiny_bound(tiny_model_dir, tokenizer, uncached, chats):
    # A block: layers x (keys, values) x KV heads x BLOCK tokens x head_dim x 4 bytes (float32).
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * BLOCK * head_dim * 4
    config = core_config(tiny_model_dir, max_batch_size=8)
    e = hf.HfEngine(
        config.model, **{**hf.engine_kwargs(config, tokenizer), "prefix_cache_bytes": 3 * block_bytes + 100}
    )
    await e.start()
    try:
        seen = []
        for i, prompt in enumerate([*chats, *chats]):
            got = await run(e, greedy(f"r{i}", prompt))
            stats = e.stats().prefix_cache
            assert stats is not None and stats.capacity == 3 and stats.blocks <= 3
            seen.append(got["cached"])
            assert_same(got, await run(uncached, greedy(f"ref{i}", prompt)))
        assert max(seen) <= 3 * BLOCK
    finally:
        await e.shutdown()


def test_a_fraction_of_a_mib_bounds_the_cache_in_bytes(tiny_model_dir, tokenizer):
    kwargs = hf.engine_kwargs(core_config(tiny_model_dir, prefix_cache_mib=0.25), tokenizer)
    assert kwargs["prefix_cache_bytes"] == 2**18
    off = hf.engine_kwargs(core_config(tiny_model_dir, prefix_cache=False, prefix_cache_mib=0.25), tokenizer)
    assert off["prefix_cache_bytes"] == 0


async def test_the_off_switch(uncached, chats):
    for i in range(2):
        assert (await run(uncached, greedy(f"r{i}", chats[0])))["cached"] == 0
    assert uncached.stats().prefix_cache is None
    assert uncached._prefix is None


async def test_counters_and_cached_tokens_cross_the_engine_process(tiny_model_dir, tokenizer, chats):
    e = hf_process.build(core_config(tiny_model_dir, engine_process=True), tokenizer)
    await e.start()
    try:
        assert e.stats().prefix_cache == PrefixCacheStats()
        first = await run(e, greedy("first", chats[0]))
        second = await run(e, greedy("second", chats[0]))
        assert (first["cached"], second["cached"]) == (0, hit(chats[0]))
        assert_same(second, first)
        await wait_for(lambda: (e.stats().prefix_cache or PrefixCacheStats()).hits > 0)
        stats = e.stats().prefix_cache
        assert stats is not None
        blocks = (len(chats[0]) + 23) // BLOCK
        assert (stats.queries, stats.hits, stats.blocks) == (2 * len(chats[0]), hit(chats[0]), blocks)
    finally:
        await e.shutdown()
    off = hf_process.build(core_config(tiny_model_dir, engine_process=True, prefix_cache=False), tokenizer)
    assert off.stats().prefix_cache is None
