"""The mock engine on its own: scheduling, draws, stopping, logprobs and lifecycle.

Outputs of one engine step share their `time`, so per-step facts (how many requests ran in a
step, when a request was admitted) are read from the outputs, never from timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from core.config import CoreConfig
from core.engine.base import OutputStream
from core.engine.mock import DEFAULT_CONTEXT_LENGTH, MockEngine, build, context_length_of
from core.errors import EngineFailure, InvalidArgument, NotReady, Overloaded
from core.sampling import resolve_generic
from core.tokenizer import Tokenizer
from core.types import EngineOutput, EngineRequest, EngineStats, FinishReason, RequestState, SamplingOptions

PROMPT = [1, 600, 601, 602]


def req(
    rid: str = "r",
    prompt: list[int] | None = None,
    *,
    max_new: int = 8,
    seed: int | None = None,
    **fields,
) -> EngineRequest:
    """An EngineRequest; a seed makes it sample, no seed decodes greedily."""
    sampling = resolve_generic(SamplingOptions(do_sample=seed is not None, seed=seed), random_seed=0)
    return EngineRequest(rid, list(prompt or PROMPT), sampling, max_new, **fields)


@pytest.fixture
async def engine(bpe_tokenizer) -> AsyncIterator[MockEngine]:
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=8, max_queue_size=16)
    await e.start()
    yield e
    await e.shutdown()


async def drain(stream: OutputStream) -> list[EngineOutput]:
    return [out async for out in stream]


def tokens(outs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outs for s in o.sequences if s.index == index for t in s.token_ids]


def finish(outs: list[EngineOutput], index: int = 0):
    return next(s for o in outs for s in o.sequences if s.index == index and s.finish_reason is not None)


async def test_lifecycle_states_then_one_token_per_step_until_length(engine, bpe_tokenizer):
    outs = await drain(engine.generate(req(max_new=6)))
    assert [o.state for o in outs[:3]] == [RequestState.QUEUED, RequestState.SCHEDULED, RequestState.PREFILLED]
    assert not outs[0].sequences and not outs[1].sequences
    token_outs = [o for o in outs if o.sequences]
    assert token_outs[0] is outs[2]  # the prefill step produces the first token
    assert [len(o.sequences[0].token_ids) for o in token_outs] == [1] * 6
    assert len({o.time for o in token_outs}) == 6  # one token per step
    assert outs[-1].finished and finish(outs).finish_reason is FinishReason.LENGTH
    ids = tokens(outs)
    assert not any(bpe_tokenizer.is_special(t) for t in ids)
    assert all(bpe_tokenizer.token_bytes(t).decode("utf-8") for t in ids)  # whole UTF-8 text each
    assert engine.stats() == EngineStats(0, 0)
    assert engine.steps == 6 and engine.step_cpu_s > 0


async def test_seeded_and_greedy_draws_are_reproducible_whatever_else_is_in_the_batch(engine):
    alone = tokens(await drain(engine.generate(req("a", seed=7, max_new=20))))
    others = [engine.generate(req(f"o{i}", [1, 700 + i], seed=i, max_new=30)) for i in range(6)]
    crowded = engine.generate(req("b", seed=7, max_new=20))
    results = await asyncio.gather(drain(crowded), *(drain(s) for s in others))
    assert tokens(results[0]) == alone
    assert tokens(await drain(engine.generate(req("c", seed=8, max_new=20)))) != alone
    assert tokens(await drain(engine.generate(req("d", [1, 999], seed=7, max_new=20)))) != alone
    greedy = tokens(await drain(engine.generate(req("g1", max_new=20))))
    assert greedy == tokens(await drain(engine.generate(req("g2", max_new=20, ignore_eos=True))))
    assert greedy != tokens(await drain(engine.generate(req("g3", [1, 5], max_new=20))))


async def test_batch_holds_at_most_max_batch_size_sequences_and_admits_at_step_boundaries(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=2)
    await e.start()
    try:
        streams = [e.generate(req(f"r{i}", max_new=3 + i)) for i in range(5)]
        assert e.stats() == EngineStats(active=0, queued=5)
        results = await asyncio.gather(*(drain(s) for s in streams))
    finally:
        await e.shutdown()
    per_step: dict[float, set[str]] = {}
    for outs in results:
        for o in outs:
            if o.sequences and o.sequences[0].token_ids:
                per_step.setdefault(o.time, set()).add(o.request_id)
    assert max(len(ids) for ids in per_step.values()) == 2
    finished_at = {outs[-1].time for outs in results}
    for outs in results[2:]:  # admitted at the boundary where an earlier request left the batch
        scheduled = next(o.time for o in outs if o.state is RequestState.SCHEDULED)
        assert scheduled in finished_at
    assert all(len(tokens(outs)) == 3 + i for i, outs in enumerate(results))


async def test_n_sequences_count_against_the_batch(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=4)
    await e.start()
    try:
        first = e.generate(req("big", seed=1, max_new=4, num_sequences=3))
        second = e.generate(req("pair", seed=2, max_new=4, num_sequences=2))
        a, b = await asyncio.gather(drain(first), drain(second))
        with pytest.raises(InvalidArgument) as err:
            e.generate(req("huge", seed=3, num_sequences=5))
        assert err.value.field == "sampling.n"
    finally:
        await e.shutdown()
    started_b = next(o.time for o in b if o.state is RequestState.SCHEDULED)
    assert started_b == a[-1].time  # 3 + 2 > 4: the pair waited for the first request to finish
    assert {s.index for o in a for s in o.sequences} == {0, 1, 2}
    assert len({tuple(tokens(a, i)) for i in range(3)}) == 3  # sampled rows differ


async def test_greedy_rows_of_one_request_are_identical(engine):
    outs = await drain(engine.generate(req(max_new=10, num_sequences=3)))
    assert tokens(outs, 0) == tokens(outs, 1) == tokens(outs, 2)
    assert outs[-1].finished and all(finish(outs, i).finish_reason is FinishReason.LENGTH for i in range(3))


async def test_closing_a_stream_frees_its_slot_within_one_step(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=1)
    await e.start()
    try:
        first = e.generate(req("long", max_new=100_000))
        waiting = e.generate(req("next", max_new=2))
        async for out in first:
            if out.sequences and len(out.sequences[0].token_ids) and out.state is None:
                break  # one decode token seen: the request is running
        before = e.steps
        await first.aclose()
        outs = []
        async for out in waiting:
            outs.append(out)
            if out.state is RequestState.SCHEDULED:
                assert e.steps - before <= 1
        assert tokens(outs) and outs[-1].finished
        assert e.stats() == EngineStats(0, 0)
    finally:
        await e.shutdown()


async def test_abort_ends_running_and_queued_requests_with_cancelled(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=2)
    await e.start()
    try:
        running = e.generate(req("run", seed=1, max_new=100_000))
        queued = e.generate(req("wait", seed=2, max_new=5, num_sequences=2))
        assert (await anext(running)).state is RequestState.QUEUED
        assert (await anext(running)).state is RequestState.SCHEDULED
        e.abort("run")
        e.abort("wait")
        e.abort("unknown")  # no-op
        run_outs, wait_outs = await drain(running), await drain(queued)
    finally:
        await e.shutdown()
    assert run_outs[-1].finished and finish(run_outs).finish_reason is FinishReason.CANCELLED
    assert wait_outs[-1].finished
    assert {s.index: s.finish_reason for s in wait_outs[-1].sequences} == {
        0: FinishReason.CANCELLED,
        1: FinishReason.CANCELLED,
    }
    assert not tokens(wait_outs)


async def test_full_queue_is_overloaded(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=1, max_queue_size=2)
    await e.start()
    try:
        streams = [e.generate(req("a")), e.generate(req("b"))]
        with pytest.raises(Overloaded):
            e.generate(req("c"))
        with pytest.raises(InvalidArgument) as err:
            e.generate(req("a"))
        assert err.value.field == "request_id"
        await asyncio.gather(*(drain(s) for s in streams))
        await drain(e.generate(req("c")))  # room again once the queue moved
    finally:
        await e.shutdown()


async def test_eos_is_drawn_with_its_probability_and_respects_min_new_tokens_and_ignore_eos(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, eos_probability=1.0)
    await e.start()
    try:
        outs = await drain(e.generate(req("e")))
        assert tokens(outs) == [bpe_tokenizer.hf.eos_token_id] and finish(outs).finish_reason is FinishReason.EOS
        outs = await drain(e.generate(req("m", min_new_tokens=3)))
        assert len(tokens(outs)) == 4 and finish(outs).finish_reason is FinishReason.EOS
        assert not any(t in bpe_tokenizer.eos_token_ids for t in tokens(outs)[:3])
        outs = await drain(e.generate(req("i", max_new=12, ignore_eos=True)))
        assert len(tokens(outs)) == 12 and finish(outs).finish_reason is FinishReason.LENGTH
        assert not set(tokens(outs)) & bpe_tokenizer.eos_token_ids
    finally:
        await e.shutdown()
    never = MockEngine(bpe_tokenizer, step_ms=0.0, eos_probability=0.0)
    await never.start()
    try:
        outs = await drain(never.generate(req("n", max_new=200)))
        assert finish(outs).finish_reason is FinishReason.LENGTH and len(tokens(outs)) == 200
    finally:
        await never.shutdown()


async def test_eos_draws_leave_the_token_stream_unchanged(bpe_tokenizer):
    """A sequence's draws do not depend on its stopping options: with ignore_eos it continues
    exactly where it would otherwise have stopped on EOS."""
    e = MockEngine(bpe_tokenizer, step_ms=0.0, eos_probability=0.1)
    await e.start()
    try:
        stopped = tokens(await drain(e.generate(req("s", seed=5, max_new=400))))
        ignoring = tokens(await drain(e.generate(req("i", seed=5, max_new=400, ignore_eos=True))))
    finally:
        await e.shutdown()
    assert stopped[-1] == bpe_tokenizer.hf.eos_token_id and len(stopped) < 400
    assert ignoring[: len(stopped) - 1] == stopped[:-1] and len(ignoring) == 400


async def test_stop_token_ids_end_a_sequence_but_not_below_min_new_tokens(engine):
    free = tokens(await drain(engine.generate(req("f", seed=3, max_new=40))))
    stop = free[5]
    first = free.index(stop)
    outs = await drain(engine.generate(req("s", seed=3, max_new=40, stop_token_ids=frozenset({stop}))))
    step = finish(outs)
    assert step.finish_reason is FinishReason.STOP_SEQUENCE and step.stop_token_id == stop
    assert tokens(outs) == free[: first + 1]
    outs = await drain(
        engine.generate(req("m", seed=3, max_new=40, stop_token_ids=frozenset({stop}), min_new_tokens=first + 1))
    )
    assert stop not in tokens(outs)[: first + 1]


async def test_context_length_bounds_the_sequence(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=0.0, max_context_length=10)
    await e.start()
    try:
        outs = await drain(e.generate(req(prompt=[1, 2, 3, 4], max_new=100)))
    finally:
        await e.shutdown()
    assert len(tokens(outs)) == 6 and finish(outs).finish_reason is FinishReason.LENGTH
    assert e.info.max_context_length == 10


async def test_logprobs_are_well_formed_and_do_not_change_the_tokens(engine):
    plain = tokens(await drain(engine.generate(req("p", seed=11, max_new=60))))
    for seed, sampled in ((11, True), (None, False)):
        outs = await drain(engine.generate(req("l", seed=seed, max_new=60, logprobs=True, top_logprobs=5)))
        ranks = []
        for o in outs:
            for s in o.sequences:
                (token,), (lp,), (top,) = s.token_ids, s.logprobs, s.top_logprobs
                values = [v for _, v in top]
                assert lp <= 0 and all(v <= 0 for v in values)
                assert values == sorted(values, reverse=True) and len(top) == 5
                assert len({i for i, _ in top}) == 5
                ids = [i for i, _ in top]
                if token in ids:
                    assert top[ids.index(token)][1] == lp
                    ranks.append(ids.index(token))
                else:
                    assert lp < values[-1]
                    ranks.append(5)
        if sampled:
            assert tokens(outs) == plain and max(ranks) > 0
        else:
            assert set(ranks) == {0}  # greedy picks the most likely token
    outs = await drain(engine.generate(req("z", max_new=3, logprobs=True)))
    assert all(s.logprobs and s.top_logprobs == [[]] for o in outs for s in o.sequences)


async def test_prompt_logprobs_are_reported_with_prefilled(engine):
    prompt = [1, 600, 601, 602, 603]
    outs = await drain(engine.generate(req("p", prompt, max_new=2, prompt_logprobs=3)))
    prefilled = next(o for o in outs if o.state is RequestState.PREFILLED)
    infos = prefilled.prompt_logprobs
    assert [i.token_id for i in infos] == prompt
    assert infos[0].logprob is None and infos[0].top == []
    for info in infos[1:]:
        values = [v for _, v in info.top]
        assert info.logprob <= 0 and len(info.top) == 3 and values == sorted(values, reverse=True)
        ids = [i for i, _ in info.top]
        if info.token_id in ids:
            assert info.top[ids.index(info.token_id)][1] == info.logprob
    again = await drain(engine.generate(req("q", prompt, max_new=2, prompt_logprobs=3)))
    assert next(o for o in again if o.state is RequestState.PREFILLED).prompt_logprobs == infos


async def test_prefill_cost_per_prompt_token_lengthens_the_admitting_step(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, prefill_ms_per_token=10.0)
    await e.start()
    try:
        outs = await drain(e.generate(req(prompt=list(range(1, 21)), max_new=1)))
    finally:
        await e.shutdown()
    scheduled = next(o.time for o in outs if o.state is RequestState.SCHEDULED)
    prefilled = next(o.time for o in outs if o.state is RequestState.PREFILLED)
    # The step is 1 ms + 20 tokens x 10 ms = 201 ms after its scheduled start; SCHEDULED is
    # stamped when the boundary's timer actually ran, which on a loaded host is late by up to
    # tens of ms, so the bound leaves 50 ms for that and still fails without the prefill cost.
    assert prefilled - scheduled >= 0.15


async def test_a_failed_step_fails_the_requests_in_it_and_the_engine_serves_on(bpe_tokenizer, monkeypatch):
    e = MockEngine(bpe_tokenizer, step_ms=1.0)
    await e.start()
    try:
        with monkeypatch.context() as m:  # a defect in token drawing, for one step

            def broken(*args):
                raise RuntimeError("boom")

            m.setattr(e, "_next_token", broken)
            outs = await drain(e.generate(req("a")))
        assert isinstance(outs[-1].error, EngineFailure) and "boom" in str(outs[-1].error)
        assert e.alive and e.stats() == EngineStats(0, 0)
        assert len(tokens(await drain(e.generate(req("b", max_new=3))))) == 3
    finally:
        await e.shutdown()


async def test_not_ready_before_start_and_after_shutdown_which_ends_every_request(bpe_tokenizer):
    e = MockEngine(bpe_tokenizer, step_ms=1.0, max_batch_size=1)
    with pytest.raises(NotReady):
        e.generate(req())
    assert not e.alive
    await e.start()
    assert e.alive
    running = e.generate(req("a", max_new=100_000))
    queued = e.generate(req("b"))
    async for out in running:
        if out.sequences:
            break
    assert e.stats() == EngineStats(active=1, queued=1)
    await e.shutdown()
    assert not e.alive and e.stats() == EngineStats(0, 0)
    for stream in (running, queued):
        last = (await drain(stream))[-1]
        assert isinstance(last.error, NotReady) and last.finished
    with pytest.raises(NotReady):
        e.generate(req("c"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step_ms": -1.0},
        {"step_ms": float("nan")},
        {"prefill_ms_per_token": -0.5},
        {"eos_probability": 1.5},
        {"max_context_length": 1},
        {"max_batch_size": 0},
    ],
)
def test_out_of_range_options_are_refused(bpe_tokenizer, kwargs):
    with pytest.raises(ValueError):
        MockEngine(bpe_tokenizer, **kwargs)


def test_build_takes_the_context_length_from_the_model_or_the_flag(tiny_model_dir, bpe_tokenizer, tmp_path):
    config = CoreConfig(model=str(tiny_model_dir), engine="mock", mock_step_ms=3.0, max_batch_size=5, max_n=8)
    e = build(config, bpe_tokenizer)
    expected = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    assert (e.info.engine, e.info.max_context_length, e.info.max_n) == ("mock", expected, 5)
    assert e.info.vocab_size == bpe_tokenizer.vocab_size
    assert context_length_of(tmp_path) == DEFAULT_CONTEXT_LENGTH
    (tmp_path / "config.json").write_text('{"n_positions": 77}')
    assert context_length_of(tmp_path) == 77
    config = CoreConfig(model=str(tmp_path), engine="mock", mock_context_length=99)
    assert build(config, bpe_tokenizer).info.max_context_length == 99


def test_a_tokenizer_only_directory_is_enough(tokenizer_only_dir):
    tokenizer = Tokenizer.load(tokenizer_only_dir)
    e = build(CoreConfig(model=str(tokenizer_only_dir), engine="mock"), tokenizer)
    assert e.info.max_context_length == DEFAULT_CONTEXT_LENGTH and e.info.vocab_size == tokenizer.vocab_size


async def test_scripted_replies_by_prompt(bpe_tokenizer, tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"when": "garden", "reply": "<think>x</think>Roses."}]))
    config = CoreConfig(model=str(tmp_path), engine="mock", mock_step_ms=1.0, mock_script=str(path))
    e = build(config, bpe_tokenizer)
    await e.start()
    try:
        prompt = bpe_tokenizer.encode("Tell me about the garden.")
        outs = await drain(e.generate(req("a", prompt, max_new=50)))
        reply = bpe_tokenizer.encode("<think>x</think>Roses.", add_special_tokens=False)
        assert tokens(outs) == [*reply, e._eos_id] and finish(outs).finish_reason == FinishReason.EOS
        assert len(bpe_tokenizer.encode("<think>", add_special_tokens=False)) > 1
        cut = await drain(e.generate(req("b", prompt, max_new=3)))
        assert tokens(cut) == reply[:3] and finish(cut).finish_reason == FinishReason.LENGTH
        on = await drain(e.generate(req("c", prompt, max_new=len(reply) + 4, ignore_eos=True)))
        assert tokens(on)[: len(reply)] == reply and len(tokens(on)) == len(reply) + 4
        other = await drain(e.generate(req("d", max_new=4)))  # no match: the usual draws
        assert tokens(other) == tokens(await drain(e.generate(req("e", max_new=4))))
    finally:
        await e.shutdown()


@pytest.mark.parametrize(
    "content", ["{", '{"when": "a", "reply": "b"}', '[{"when": "a"}]', '[{"when": 1, "reply": "b"}]']
)
def test_a_bad_script_is_refused(bpe_tokenizer, tmp_path, content):
    path = tmp_path / "script.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="mock script"):
        build(CoreConfig(model=str(tmp_path), engine="mock", mock_script=str(path)), bpe_tokenizer)
    with pytest.raises(ValueError, match="cannot read"):
        build(CoreConfig(model=str(tmp_path), engine="mock", mock_script=str(tmp_path / "none.json")), bpe_tokenizer)
