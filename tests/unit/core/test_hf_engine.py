"""The HF engine at token level on the tiny model: admission refusals, a failed step, a dead
worker and shutdown (the paths the gRPC tests cannot reach through validation), and guided
decoding (schema-valid JSON from seeded sampling, regex, choice, grammars, mixed batches)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from core.engine import hf
from core.errors import EngineDead, EngineFailure, InvalidArgument, NotReady
from core.sampling import resolve_generic
from core.types import EngineOutput, EngineRequest, FinishReason, Guide, SamplingOptions
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle


@pytest.fixture
async def engine(tiny_model_dir, tokenizer):
    """A started HF engine of its own (shut down afterwards, whatever the test did to it)."""
    e = hf.build(core_config(tiny_model_dir), tokenizer)
    await e.start()
    yield e
    await e.shutdown()


def req(request_id: str, prompt: list[int], max_new_tokens: int = 4, n: int = 1) -> EngineRequest:
    sampling = resolve_generic(SamplingOptions(), random_seed=1)
    return EngineRequest(request_id, prompt, sampling, max_new_tokens, num_sequences=n, ignore_eos=True)


async def until_tokens(gen) -> None:
    """Consume outputs until one carries tokens."""
    async for out in gen:
        if any(s.token_ids for s in out.sequences):
            return
    raise AssertionError("the request ended without tokens")


async def last_output(gen) -> EngineOutput:
    outs = [out async for out in gen]
    return outs[-1]


async def test_refused_before_start(tiny_model_dir, tokenizer):
    e = hf.build(core_config(tiny_model_dir), tokenizer)
    with pytest.raises(NotReady):
        e.generate(req("early", [1, 5]))


async def test_a_running_request_id_is_refused_until_it_ends(engine):
    gen = engine.generate(req("dup", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    with pytest.raises(InvalidArgument, match="already running") as info:
        engine.generate(req("dup", [1, 5]))
    assert info.value.field == "request_id"
    await gen.aclose()  # the consumer leaves: the engine aborts the request
    await wait_idle(engine)
    out = await last_output(engine.generate(req("dup", [1, 5])))
    assert out.finished and out.sequences[0].finish_reason is FinishReason.LENGTH


async def test_more_than_the_batch_can_hold_is_refused(engine):
    with pytest.raises(InvalidArgument) as info:
        engine.generate(req("wide", [1, 5], n=99))
    assert info.value.field == "sampling.n"


async def test_a_failed_step_fails_its_request_not_the_engine(engine):
    out = await last_output(engine.generate(req("bad", [1, 10**6])))  # an id past the embedding table
    assert isinstance(out.error, EngineFailure) and "Generation failed" in str(out.error)
    assert engine.alive
    out = await last_output(engine.generate(req("good", [1, 5])))
    assert out.finished and out.error is None
    await wait_idle(engine)


async def test_a_dead_worker_fails_its_requests_and_reports_once(engine, monkeypatch):
    deaths: list[Exception] = []
    engine.set_on_dead(deaths.append)
    gen = engine.generate(req("victim", [1, 5], max_new_tokens=900))
    await until_tokens(gen)

    def broken(emits):  # outside the per-step guard: the worker itself fails
        raise RuntimeError("worker bug")

    monkeypatch.setattr(engine, "_finish_step", broken)
    out = await last_output(gen)
    assert isinstance(out.error, EngineDead) and "worker bug" in str(out.error)
    await wait_for(lambda: deaths)
    assert [str(d) for d in deaths] == ["worker bug"] and not engine.alive
    with pytest.raises(EngineDead):
        engine.generate(req("after", [1, 5]))


async def test_shutdown_ends_running_requests_with_not_ready(engine):
    gen = engine.generate(req("running", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    await engine.shutdown()
    out = await last_output(gen)
    assert isinstance(out.error, NotReady) and not engine.alive
    with pytest.raises(NotReady):
        engine.generate(req("late", [1, 5]))


async def test_a_prompt_longer_than_the_cache_after_it_emptied(engine):
    """The cache grows before a long prompt lands on an empty timeline (regression: the timeline
    passed the old buffers' end before they grew)."""
    out = await last_output(engine.generate(req("short", [1, 5], max_new_tokens=2)))
    assert out.finished and out.error is None
    capacity = engine._cache.capacity
    out = await last_output(engine.generate(req("long", [1] + [9] * (capacity + 40), max_new_tokens=2)))
    assert out.finished and out.error is None


# ----------------------------------------------------------------------------- guided decoding


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "verified": {"type": "boolean"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                    "required": ["lat"],
                    "additionalProperties": False,
                },
            },
            "required": ["zip", "verified", "geo"],
            "additionalProperties": False,
        },
        "score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    },
    "required": ["name", "age", "tags", "address", "score"],
    "additionalProperties": False,
}


def guided(request_id: str, prompt: list[int], guide: Guide | None, *, seed: int, max_new_tokens: int = 120):
    sampling = resolve_generic(SamplingOptions(do_sample=True, temperature=1.0), random_seed=seed)
    return EngineRequest(request_id, prompt, sampling, max_new_tokens, guide=guide)


async def collect(engine, r: EngineRequest) -> tuple[list[int], FinishReason | None]:
    """Run one request to its end: its tokens and finish reason."""
    tokens, reason = [], None
    async for out in engine.generate(r):
        for s in out.sequences:
            tokens += s.token_ids
            reason = s.finish_reason or reason
    return tokens, reason


async def run_all(engine, requests) -> list[tuple[list[int], FinishReason | None]]:
    """Run requests at once (one batch); each request's tokens and finish reason."""
    return await asyncio.gather(*(collect(engine, r) for r in requests))


def text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


async def test_fifty_seeded_requests_all_produce_schema_valid_json(engine, tokenizer):
    guide = Guide("json_schema", json.dumps(NESTED))
    prompt = tokenizer.encode("Describe a person:")
    requests = [guided(f"s{seed}", prompt, guide, seed=seed) for seed in range(50)]
    results = await run_all(engine, requests)
    outputs = set()
    for tokens, reason in results:
        assert reason is FinishReason.EOS, text(tokenizer, tokens)
        value = json.loads(text(tokenizer, tokens))
        jsonschema.validate(value, NESTED)
        outputs.add(json.dumps(value))
    assert len(outputs) > 40  # seeds differ, so outputs do
    assert engine._guides.compilations == 1  # compiled once, then served from the cache


async def test_a_regex_and_a_choice_list(engine, tokenizer):
    prompt = tokenizer.encode("Code:")
    results = await run_all(
        engine,
        [guided(f"r{seed}", prompt, Guide("regex", "[A-F]{2}-[0-9]{3}"), seed=seed) for seed in range(5)]
        + [
            guided(f"c{seed}", prompt, Guide("choice", choices=("apple", "pear", "kiwi fruit")), seed=seed)
            for seed in range(5)
        ],
    )
    for tokens, reason in results[:5]:
        assert reason is FinishReason.EOS and re.fullmatch("[A-F]{2}-[0-9]{3}", text(tokenizer, tokens))
    for tokens, reason in results[5:]:
        assert reason is FinishReason.EOS and text(tokenizer, tokens) in ("apple", "pear", "kiwi fruit")


async def test_guided_and_free_rows_share_a_batch(engine, tokenizer):
    """A mixed batch: the free rows sample exactly as they do alone (same seeds, same tokens),
    the guided rows follow their guides."""
    prompt = tokenizer.encode("Hello")
    free = [guided(f"alone{seed}", prompt, None, seed=seed, max_new_tokens=12) for seed in range(3)]
    alone = await run_all(engine, free)
    mixed = await run_all(
        engine,
        [guided(f"free{seed}", prompt, None, seed=seed, max_new_tokens=12) for seed in range(3)]
        + [guided("json", prompt, Guide("json_schema", json.dumps(NESTED)), seed=7)]
        + [guided("lark", prompt, Guide("lark_grammar", 'start: "ab" /[0-9]/'), seed=7)]
        + [guided("ebnf", prompt, Guide("ebnf_grammar", 'root ::= "x" [yz]'), seed=7)]
        + [guided("object", prompt, Guide("json_object"), seed=7, max_new_tokens=24)],
    )
    assert [tokens for tokens, _ in mixed[:3]] == [tokens for tokens, _ in alone]
    jsonschema.validate(json.loads(text(tokenizer, mixed[3][0])), NESTED)
    assert re.fullmatch("ab[0-9]", text(tokenizer, mixed[4][0]))
    assert re.fullmatch("x[yz]", text(tokenizer, mixed[5][0]))
    obj_text = text(tokenizer, mixed[6][0])
    assert obj_text.startswith("{") and (mixed[6][1] is not FinishReason.EOS or isinstance(json.loads(obj_text), dict))


async def test_guides_stay_valid_as_rows_join_leave_and_are_cancelled(engine, tokenizer):
    """The batch changes between decode steps while guided rows run: requests join one by one,
    free rows and short guides leave early, and guided requests are cancelled mid-stream (the
    engine removes them at the next step boundary, after masks for that step were computed).
    Every guided row still gets the masks of its own accepted tokens: each output that ends by
    EOS matches its guide, and the free rows (unmasked) run to their length."""
    prompt = tokenizer.encode("Hello")
    regex = Guide("regex", "[A-F]{2}-[0-9]{3}")
    schema = Guide("json_schema", json.dumps(NESTED))

    async def cancelled(request_id: str, guide: Guide) -> None:
        gen = engine.generate(guided(request_id, prompt, guide, seed=5))
        await until_tokens(gen)
        await gen.aclose()  # the consumer leaves: aborted at the next step boundary

    choice = Guide("choice", choices=("ab", "cde"))
    running = []

    def join(request_id: str, guide: Guide | None, seed: int, max_new_tokens: int = 120) -> None:
        r = guided(request_id, prompt, guide, seed=seed, max_new_tokens=max_new_tokens)
        running.append(asyncio.create_task(collect(engine, r)))

    join("long", schema, 11)
    for seed in range(3):
        join(f"free{seed}", None, seed, max_new_tokens=6)
        join(f"regex{seed}", regex, seed)
        await cancelled(f"cut{seed}", schema if seed % 2 else regex)
        join(f"choice{seed}", choice, seed)
    results = await asyncio.gather(*running)
    await wait_idle(engine)
    tokens, reason = results[0]
    assert reason is FinishReason.EOS
    jsonschema.validate(json.loads(text(tokenizer, tokens)), NESTED)
    for seed in range(3):
        free, rx, choice = results[1 + 3 * seed : 4 + 3 * seed]
        assert free[1] is FinishReason.LENGTH and len(free[0]) == 6
        assert rx[1] is FinishReason.EOS and re.fullmatch("[A-F]{2}-[0-9]{3}", text(tokenizer, rx[0]))
        assert choice[1] is FinishReason.EOS and text(tokenizer, choice[0]) in ("ab", "cde")


async def test_n_sequences_each_follow_the_guide(engine, tokenizer):
    sampling = resolve_generic(SamplingOptions(do_sample=True), random_seed=3)
    request = EngineRequest(
        "n3", tokenizer.encode("x"), sampling, 30, num_sequences=3, guide=Guide("regex", "[a-z]{3}")
    )
    texts: dict[int, list[int]] = {}
    async for out in engine.generate(request):
        for s in out.sequences:
            texts.setdefault(s.index, []).extend(s.token_ids)
    assert len(texts) == 3 and all(re.fullmatch("[a-z]{3}", text(tokenizer, t)) for t in texts.values())


async def test_a_guide_that_does_not_compile_is_refused_at_admission(engine):
    with pytest.raises(InvalidArgument) as info:
        engine.generate(guided("bad", [1, 5], Guide("lark_grammar", "start: nowhere"), seed=1))
    assert info.value.field == "guided_decoding.lark_grammar"


async def test_the_compiled_guide_cache_is_bounded(tiny_model_dir, tokenizer):
    e = hf.build(core_config(tiny_model_dir, guide_cache_size=2), tokenizer)
    await e.start()
    try:
        for i in range(4):
            e._guides.compiled(Guide("regex", f"a{{{i + 1}}}"))
        assert len(e._guides._cache) == 2 and e._guides.compilations == 4
        e._guides.compiled(Guide("regex", "a{4}"))  # the most recent one is still cached
        assert e._guides.compilations == 4
    finally:
        await e.shutdown()
