"""The HF engine's packed step (core.engine.hf_cache.StepPlan): requests admitted while others
run are prefilled in the same forward as the running sequences' decode tokens ("mixed" steps in
the engine's step trace). Each test forces that schedule (a long request runs while the others
join), checks in the trace that mixed steps happened, and compares every joining request with
the same request alone: greedy tokens, prompt logprobs, seeded sampling, n > 1, stop tokens, a
request finishing at its first token, a cancellation, and guided decoding."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from core.engine import hf
from core.sampling import resolve_generic
from core.types import EngineRequest, FinishReason, Guide, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle
from tests.unit.core.test_hf_batch_invariance import PROMPTS
from tests.unit.core.test_hf_engine import until_tokens


@pytest.fixture
def trace(tmp_path) -> Path:
    return tmp_path / "steps.txt"


@pytest.fixture
async def engine(tiny_model_dir, tokenizer, trace):
    e = hf.build(core_config(tiny_model_dir, max_batch_size=24, hf_step_trace=str(trace)), tokenizer)
    await e.start()
    yield e
    await e.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def request(request_id: str, prompt: list[int], max_new_tokens: int = 16, **fields) -> EngineRequest:
    opts = fields.pop("sampling", SamplingOptions())
    sampling = resolve_generic(opts, random_seed=fields.pop("seed", 1))
    fields.setdefault("ignore_eos", True)
    return EngineRequest(request_id, prompt, sampling, max_new_tokens, **fields)


async def run(engine, r: EngineRequest) -> dict:
    """One request's outputs: tokens per sequence, finish reasons, logprobs, prompt logprobs."""
    seqs: dict[int, list[int]] = {}
    reasons: dict[int, FinishReason | None] = {}
    logprobs: dict[int, list[float]] = {}
    prompt = None
    async for out in engine.generate(r):
        prompt = out.prompt_logprobs or prompt
        for s in out.sequences:
            seqs.setdefault(s.index, []).extend(s.token_ids)
            logprobs.setdefault(s.index, []).extend(s.logprobs or [])
            reasons[s.index] = s.finish_reason or reasons.get(s.index)
    return {"tokens": seqs, "reasons": reasons, "logprobs": logprobs, "prompt": prompt}


def kinds(trace: Path) -> list[str]:
    return [line.split()[0] for line in trace.read_text().splitlines()]


async def while_running(engine, prompts, make) -> list[dict]:
    """Run `make(i, prompt)` for each prompt while a long request decodes, so each one joins the
    running batch; the long request is cancelled afterwards."""
    long = engine.generate(request("long", prompts[2], 900))
    await until_tokens(long)
    try:
        return await asyncio.gather(*(run(engine, make(i, p)) for i, p in enumerate(prompts)))
    finally:
        await long.aclose()
        await wait_idle(engine)


async def test_joining_requests_get_their_tokens_and_logprobs_alone(engine, prompts, trace):
    def make(tag):
        return lambda i, p: request(f"{tag}{i}", p, logprobs=True, top_logprobs=2, prompt_logprobs=1)

    alone = [await run(engine, make("alone")(i, p)) for i, p in enumerate(prompts)]
    assert "mixed" not in kinds(trace)
    joined = await while_running(engine, prompts, make("joined"))
    assert "mixed" in kinds(trace)
    for a, j in zip(alone, joined, strict=True):
        assert j["tokens"] == a["tokens"]
        assert j["logprobs"][0] == pytest.approx(a["logprobs"][0], abs=1e-5)
        assert [p.token_id for p in j["prompt"]] == [p.token_id for p in a["prompt"]]
        assert [p.logprob for p in j["prompt"][1:]] == pytest.approx([p.logprob for p in a["prompt"][1:]], abs=1e-5)


async def test_requests_arriving_one_by_one_join_a_running_batch(engine, prompts, trace):
    """Staggered arrivals: each step admits whoever arrived, next to everyone decoding."""
    alone = [(await run(engine, request(f"alone{i}", p, 24)))["tokens"] for i, p in enumerate(prompts * 3)]

    async def late(i: int, p: list[int]) -> dict:
        await asyncio.sleep(0.01 * i)
        return await run(engine, request(f"late{i}", p, 24))

    joined = await asyncio.gather(*(late(i, p) for i, p in enumerate(prompts * 3)))
    assert [j["tokens"] for j in joined] == alone
    assert "mixed" in kinds(trace)


async def test_seeded_sampling_and_n_sequences_joining(engine, prompts):
    sampling = SamplingOptions(do_sample=True, temperature=0.9, top_k=20)

    def make(tag):
        return lambda i, p: request(f"{tag}{i}", p, sampling=sampling, seed=100 + i, num_sequences=3)

    alone = [(await run(engine, make("alone")(i, p)))["tokens"] for i, p in enumerate(prompts)]
    joined = [j["tokens"] for j in await while_running(engine, prompts, make("joined"))]
    assert joined == alone
    assert all(len(seqs) == 3 for seqs in joined)


async def test_stop_tokens_and_a_request_that_ends_at_its_first_token(engine, prompts):
    greedy = (await run(engine, request("probe", prompts[0])))["tokens"][0]
    stop = greedy[2]
    make = [
        lambda i, p: request(f"stop{i}", p, stop_token_ids=frozenset({stop})),
        lambda i, p: request(f"one{i}", p, 1),
        lambda i, p: request(f"after{i}", p),
    ]
    results = await while_running(engine, [prompts[0]] * 3, lambda i, p: make[i](i, p))
    assert results[0]["tokens"][0] == greedy[: greedy.index(stop) + 1]
    assert results[0]["reasons"][0] is FinishReason.STOP_SEQUENCE
    assert results[1]["tokens"][0] == greedy[:1] and results[1]["reasons"][0] is FinishReason.LENGTH
    assert results[2]["tokens"][0] == greedy


async def test_a_request_cancelled_as_it_joins_leaves_the_others_intact(engine, prompts, trace):
    expected = [(await run(engine, request(f"alone{i}", p, 24)))["tokens"] for i, p in enumerate(prompts)]
    long = engine.generate(request("long", prompts[2], 900))
    await until_tokens(long)
    keep = asyncio.create_task(run(engine, request("keep", prompts[0], 24)))
    gone = engine.generate(request("gone", prompts[1], 900))
    await until_tokens(gone)
    await gone.aclose()  # aborted at the next step boundary: its slot is free again
    await wait_for(lambda: engine.stats().active == 2)
    after = await asyncio.gather(*(run(engine, request(f"after{i}", p, 24)) for i, p in enumerate(prompts)))
    assert (await keep)["tokens"] == expected[0]
    assert [a["tokens"] for a in after] == expected
    await long.aclose()
    await wait_idle(engine)
    assert "mixed" in kinds(trace)


async def test_a_guided_request_joining_a_running_batch(engine, tokenizer, prompts):
    guide = Guide("regex", "[A-F]{2}-[0-9]{3}")

    def make(tag):
        return lambda i, p: request(f"{tag}{i}", p, 30, guide=guide, ignore_eos=False)

    alone = [(await run(engine, make("alone")(i, p)))["tokens"] for i, p in enumerate(prompts)]
    joined = [j["tokens"] for j in await while_running(engine, prompts, make("joined"))]
    assert joined == alone
    for seqs in joined:
        assert re.fullmatch("[A-F]{2}-[0-9]{3}", tokenizer.decode(seqs[0], skip_special_tokens=True))


async def test_decode_attention_skips_the_columns_no_running_sequence_needs(engine, prompts, trace, monkeypatch):
    """Once the request that started the timeline leaves, decode steps attend from the oldest
    running sequence's first column on (StepPlan.first), with the same tokens and logprobs."""
    alone = await run(engine, request("alone", prompts[1], 48, logprobs=True))
    firsts: list[int] = []
    plan = engine._plan

    def recording(*args):
        p = plan(*args)
        firsts.append(p.first)
        return p

    monkeypatch.setattr(engine, "_plan", recording)
    long = engine.generate(request("long", prompts[2], 900))
    await until_tokens(long)
    late = asyncio.create_task(run(engine, request("late", prompts[1], 48, logprobs=True)))
    await wait_for(lambda: engine.stats().active == 2)
    await long.aclose()
    joined = await late
    assert joined["tokens"] == alone["tokens"]
    assert joined["logprobs"][0] == pytest.approx(alone["logprobs"][0], abs=1e-5)
    assert 0 in firsts and firsts[-1] > 0  # from column 0 while "long" runs, later from "late"'s first
    await wait_idle(engine)
    for line in trace.read_text().splitlines():  # kind, sequences, tokens, forward s, step s
        kind, rows, tokens, forward_s, step_s = line.split()
        assert kind in ("decode", "prefill", "mixed") and 0 < int(rows) <= int(tokens)
        assert 0 < float(forward_s) <= float(step_s)
