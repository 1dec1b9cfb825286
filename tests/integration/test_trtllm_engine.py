"""`--engine trtllm` against the executor double, through the real core and gRPC on loopback.

The double (tests/fakes/trtllm_executor.py) reproduces the documented executor behaviour of
each binding era; tests that depend on naming run on all three eras.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.errors import InvalidArgument, NotReady
from core.types import EngineRequest, RequestState, SamplingOptions
from gateways.common.status import GatewayError
from tests.conftest import core_config
from tests.fakes import trtllm_executor, trtllm_llm
from tests.fakes.trtllm_harness import (
    collect,
    finish_of,
    make_engine_output,
    serve_engine,
    text_of,
    tokens_of,
)
from tests.fakes.trtllm_model import FakeModel
from tests.integration.core_helpers import request_of as request
from tests.integration.core_helpers import wait_for, wait_health, wait_idle

ERAS = ["0.11", "0.15", "1.0"]
MODEL = FakeModel(4096)


@pytest.fixture
def engine_out(tmp_path, tiny_model_dir):
    """Factory: a build output (engine/ + manifest) with the given engine limits."""

    def make(**limits):
        return make_engine_output(tmp_path / "out", tiny_model_dir, **limits)

    return make


def executor_of(server):
    return server.engine._executor


async def read_rest(call) -> list:
    """The remaining messages of a call already read with `read()` (the APIs cannot be mixed)."""
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


def sent(server, messages=None):
    """The executor Request of the most recent (or only) request."""
    requests = executor_of(server).fake_requests
    return requests[max(requests)]


# --------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("era", ERAS)
async def test_streams_greedy_tokens_in_order(monkeypatch, tokenizer, engine_out, era):
    tl = trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 8}))
        prompt = tokenizer.encode("hello")
        expected, _ = MODEL.greedy(prompt, 8)
        assert tokens_of(msgs) == expected
        assert text_of(msgs) == tokenizer.decode(expected)
        states = [m.state for m in msgs if m.state]
        assert states == [
            pb.GENERATE_STATE_QUEUED,
            pb.GENERATE_STATE_SCHEDULED,
            pb.GENERATE_STATE_PREFILLED,
            pb.GENERATE_STATE_GENERATING,
        ]
        assert sum(1 for m in msgs if any(o.tokens for o in m.outputs)) >= 2  # streamed, not buffered
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.completion_tokens == 8 and msgs[-1].usage.prompt_tokens == len(prompt)
        r = sent(server)
        assert r.streaming is True and r.end_id == 2 and r.pad_id == 0
        assert r.stop_words == [[7]]  # the other EOS id, as a one-token stop word
        assert r.output_config.exclude_input_from_output is True
        seed = r.sampling_config.random_seed if era == "0.11" else r.sampling_config.seed
        assert seed == msgs[-1].seed
        assert tl.fake_era == era
        assert server.engine.stats().active == 0 and server.engine.stats().queued == 0
        stats = server.engine.iteration_stats()  # drained
        assert stats and '"num_active_requests"' in stats[-1] and server.engine.iteration_stats() == []


async def test_several_responses_in_one_batch_are_concatenated(monkeypatch, tokenizer, engine_out):
    # a consumer that falls behind gets several Responses of one id in one batch, and the
    # final one may be empty (END_ID is excluded). Responses are built by hand (Result and
    # Response are constructible) and dispatched as the awaiter would.
    tl = trtllm_executor.install(monkeypatch, "1.0")
    engine = trtllm.build(core_config(engine_out(), engine="trtllm"), tokenizer)
    await engine.start()
    try:
        engine._executor.fake_pause()
        req = EngineRequest(
            "b1", tokenizer.encode("hi"), engine.resolve_sampling(SamplingOptions(), random_seed=1), 8, logprobs=True
        )
        gen = engine.generate(req)
        assert (await gen.__anext__()).state is RequestState.QUEUED
        rid = max(engine._executor.fake_requests)

        def response(tokens, logprobs, final):
            res = tl.Result()
            res.output_token_ids = [tokens]
            res.log_probs = [logprobs]  # cumulative, as in E2
            res.is_final = res.is_sequence_final = final
            res.finish_reasons = [tl.FinishReason.END_ID if final else tl.FinishReason.NOT_FINISHED]
            return tl.Response(rid, res)

        engine._dispatch(
            [response([11], [-0.5], False), response([12], [-0.5, -0.25], False), response([], [-0.5, -0.25], True)], []
        )
        first = await gen.__anext__()
        assert first.state is RequestState.PREFILLED
        assert first.sequences[0].token_ids == [11, 12] and first.sequences[0].logprobs == [-0.5, -0.25]
        assert first.sequences[0].finish_reason is None and not first.finished
        last = await gen.__anext__()
        assert last.finished and last.sequences[0].token_ids == [] and last.sequences[0].finish_reason.name == "EOS"
        await gen.aclose()
        assert engine.stats().active == 0 and not engine._live
    finally:
        await engine.shutdown()


async def test_concurrent_requests_batch_in_flight(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    prompts = [f"prompt number {i}" for i in range(8)]
    async with serve_engine(trtllm.build, engine_out(max_batch_size=4), tokenizer, engine="trtllm") as (server, stub):
        results = await asyncio.gather(*(collect(stub, request(p, stopping={"max_new_tokens": 6})) for p in prompts))
        for p, msgs in zip(prompts, results, strict=True):
            assert tokens_of(msgs) == MODEL.greedy(tokenizer.encode(p), 6)[0]
        ex = executor_of(server)
        assert len(ex.fake_requests) == 8 and ex.fake_concurrent_enqueues == 0
        assert ex.config.max_batch_size == 4  # --max-batch-size 16, capped by the engine's build value


# --------------------------------------------------------------------------------- defaults


DEFAULT_CASES = [
    # (client sampling, effective (do_sample, temperature, top_k, top_p), sent (top_k, top_p, temperature))
    ({}, (False, 0.8, None, None), (None, None, None)),
    ({"do_sample": True}, (True, 1.0, 5, 0.85), (5, 0.85, 1.0)),
    ({"temperature": 0.7}, (True, 0.7, 5, 0.85), (5, 0.85, 0.7)),
    ({"top_k": 40}, (True, 1.0, 40, 0.85), (40, 0.85, 1.0)),
    ({"do_sample": True, "temperature": 0.0}, (False, 0.0, None, None), (None, None, None)),
    ({"do_sample": False, "top_k": 40, "top_p": 0.5}, (False, 0.8, None, None), (None, None, None)),
    ({"do_sample": True, "top_p": 1.0, "top_k": 0}, (True, 1.0, 0, 1.0), (0, 1.0, 1.0)),
]


@pytest.mark.parametrize("client, effective, sent_values", DEFAULT_CASES)
async def test_sampling_defaults_reported_and_sent(monkeypatch, tokenizer, engine_out, client, effective, sent_values):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(sampling=dict(client), stopping={"max_new_tokens": 2}))
        eff = msgs[-1].effective_sampling
        got = (
            eff.do_sample,
            round(eff.temperature, 4) if eff.HasField("temperature") else None,
            eff.top_k if eff.HasField("top_k") else None,
            round(eff.top_p, 4) if eff.HasField("top_p") else None,
        )
        assert got == effective
        sc = sent(server).sampling_config
        assert (
            sc.top_k,
            None if sc.top_p is None else round(sc.top_p, 4),
            None if sc.temperature is None else round(sc.temperature, 4),
        ) == sent_values
        assert sc.seed == msgs[-1].seed


async def test_seeds_are_random_unless_given_and_reproducible(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        a = await collect(stub, request(sampling={"do_sample": True}, stopping={"max_new_tokens": 6}))
        b = await collect(stub, request(sampling={"do_sample": True}, stopping={"max_new_tokens": 6}))
        assert a[-1].seed != b[-1].seed
        c = await collect(stub, request(sampling={"do_sample": True, "seed": 11}, stopping={"max_new_tokens": 6}))
        d = await collect(stub, request(sampling={"do_sample": True, "seed": 11}, stopping={"max_new_tokens": 6}))
        assert c[-1].seed == d[-1].seed == 11 and tokens_of(c) == tokens_of(d)
        e = await collect(stub, request(sampling={"do_sample": True, "seed": -3}, stopping={"max_new_tokens": 2}))
        assert e[-1].seed == -3 and sent(server).sampling_config.seed == (-3) & ((1 << 64) - 1)


# --------------------------------------------------------------------------------- stops and EOS


def _first_unique(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("era", ERAS)
async def test_stop_token_ends_with_its_id(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    prompt = tokenizer.encode("hello")
    greedy, _ = MODEL.greedy(prompt, 12)
    i = _first_unique(greedy, 2)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 12, "stop_token_ids": [greedy[i]]}))
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert last.stop_token_id == greedy[i]
        assert tokens_of(msgs) == greedy[: i + 1]  # the executor keeps stop tokens in the output
        assert text_of(msgs) == tokenizer.decode(greedy[:i])  # the pipeline drops its text
        assert [greedy[i]] in sent(server).stop_words


async def test_stop_string_matched_on_text(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    prompt = tokenizer.encode("hello")
    greedy, _ = MODEL.greedy(prompt, 16)
    full = tokenizer.decode(greedy)
    cut = next(
        k
        for k in range(3, 12)
        if full.startswith(tokenizer.decode(greedy[:k]))
        and (p := len(tokenizer.decode(greedy[:k]))) < len(full) - 3
        and full[p : p + 3].strip()
        and "\ufffd" not in full[: p + 3]
        and full.find(full[p : p + 3]) == p
    )
    p = len(tokenizer.decode(greedy[:cut]))
    stop = full[p : p + 3]
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 16, "stop": [stop]}))
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and last.stop_sequence == stop
        assert text_of(msgs) == full[:p]
        assert tokenizer.encode(stop, add_special_tokens=False) in sent(server).stop_words
        await wait_idle(server.engine)


@pytest.mark.parametrize("era", ERAS)
async def test_eos_ends_the_sequence_and_is_excluded(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(sampling={"logit_bias": {2: 100.0}}, stopping={"max_new_tokens": 10}))
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_EOS
        # The runtime's default min_tokens of 1 bans the end token at the first step; the end
        # token itself is not in the output (an empty final response carries the reason).
        toks = tokens_of(msgs)
        assert len(toks) == 1 and 2 not in toks
        assert msgs[-1].usage.completion_tokens == 1
        assert tuple(sent(server).embedding_bias.shape) == (4096,)


async def test_other_eos_id_is_a_stop_word_reported_as_eos(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (_server, stub):
        msgs = await collect(stub, request(sampling={"logit_bias": {7: 100.0}}, stopping={"max_new_tokens": 10}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS
        assert tokens_of(msgs) == [7] and text_of(msgs) == ""


async def test_ignore_eos_sends_no_end_id(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(
            stub, request(sampling={"logit_bias": {2: 100.0}}, stopping={"max_new_tokens": 4, "ignore_eos": True})
        )
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens_of(msgs) == [2, 2, 2, 2]
        r = sent(server)
        assert r.end_id == -1 and r.stop_words is None


async def test_min_new_tokens_defers_stop_tokens_to_the_engine(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    prompt = tokenizer.encode("hello")
    greedy, _ = MODEL.greedy(prompt, 10)
    i = _first_unique(greedy, 4)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(
            stub, request(stopping={"max_new_tokens": 10, "min_new_tokens": 2, "stop_token_ids": [greedy[i]]})
        )
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and last.stop_token_id == greedy[i]
        assert tokens_of(msgs) == greedy[: i + 1]
        r = sent(server)
        assert r.stop_words is None and r.sampling_config.min_tokens == 2
        rid = max(executor_of(server).fake_requests)
        await wait_for(lambda: rid in executor_of(server).fake_cancel_calls)  # the engine stopped it
        await wait_idle(server.engine)
        # A stop token inside the first min_new_tokens does not stop.
        j = _first_unique(greedy, 0)
        msgs = await collect(
            stub, request(stopping={"max_new_tokens": 3, "min_new_tokens": 3, "stop_token_ids": [greedy[j]]})
        )
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH and tokens_of(msgs) == greedy[:3]


async def test_bad_words_are_banned(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    prompt = tokenizer.encode("hello")
    greedy, _ = MODEL.greedy(prompt, 1)
    word = tokenizer.decode([greedy[0]])
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(sampling={"bad_words": [word]}, stopping={"max_new_tokens": 2}))
        assert tokens_of(msgs)[0] != greedy[0]
        assert sent(server).bad_words == [tokenizer.encode(word, add_special_tokens=False)]


# --------------------------------------------------------------------------------- n, logprobs


@pytest.mark.parametrize("era", ["1.0"])
async def test_n_sequences_come_back_by_index(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(
            stub, request(sampling={"n": 3, "do_sample": True, "seed": 5}, stopping={"max_new_tokens": 5})
        )
        for i in range(3):
            assert len(tokens_of(msgs, i)) == 5
            assert finish_of(msgs, i).finish_reason == pb.FINISH_REASON_LENGTH
        assert len({tuple(tokens_of(msgs, i)) for i in range(3)}) > 1
        assert sent(server).sampling_config.num_return_sequences == 3
        assert msgs[-1].usage.completion_tokens == 15
        msgs = await collect(
            stub, request(sampling={"n": 1, "best_of": 3, "do_sample": True}, stopping={"max_new_tokens": 4})
        )
        assert {o.index for m in msgs for o in m.outputs} == {0}
        assert sent(server).sampling_config.num_return_sequences == 3


@pytest.mark.parametrize("era", ["0.11", "0.15"])  # 0.15 has it on the Request only, which we do not use
async def test_n_is_refused_without_num_return_sequences(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (_server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert info.max_n == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(sampling={"n": 2, "do_sample": True}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "sampling.n"


@pytest.mark.parametrize("era", ERAS)
async def test_logprobs_are_per_token(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    prompt = tokenizer.encode("hello")
    expected, lps = MODEL.greedy(prompt, 6)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 6}, output={"logprobs": True}))
        got = [t.logprob for m in msgs for o in m.outputs for t in o.tokens]
        assert tokens_of(msgs) == expected
        assert got == pytest.approx(lps, abs=1e-4)
        assert finish_of(msgs).cumulative_logprob == pytest.approx(sum(lps), abs=1e-3)
        assert sent(server).output_config.return_log_probs is True


async def test_top_logprobs_are_refused(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(output={"logprobs": True, "top_logprobs": 2}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "output.top_logprobs"
        assert executor_of(server).fake_requests == {}


async def test_prompt_logprobs_need_context_logits(monkeypatch, tokenizer, engine_out, tmp_path, tiny_model_dir):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (_server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(output={"prompt_logprobs": 0}))
        assert GatewayError.from_rpc_error(e.value).param == "output.prompt_logprobs"
    out = make_engine_output(tmp_path / "ctx", tiny_model_dir, gather_context_logits=True)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", trt_request_stats_max_iterations=100) as (
        _server,
        stub,
    ):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 2}, output={"prompt_logprobs": 2}))
        prompt = tokenizer.encode("hello")
        got = [t for m in msgs for t in m.prompt_tokens]
        assert [t.id for t in got] == prompt
        assert not got[0].HasField("logprob")
        want = float(MODEL.logits(prompt[:1]).log_softmax(-1)[prompt[1]])
        assert got[1].logprob == pytest.approx(want, abs=1e-4) and len(got[1].top_logprobs) == 2


# --------------------------------------------------------------------------------- admission, cancel


@pytest.mark.parametrize("era", ERAS)
async def test_queue_full_is_resource_exhausted(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm", max_queue_size=1) as (server, stub):
        ex = executor_of(server)
        ex.fake_pause()
        first = stub.Generate(request(stopping={"max_new_tokens": 3}))
        assert (await first.read()).state == pb.GENERATE_STATE_QUEUED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(stopping={"max_new_tokens": 3}))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.engine.stats().queued == 1
        ex.fake_resume()
        rest = await read_rest(first)
        assert finish_of(rest).finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("era", ERAS)
async def test_cancel_reaches_the_executor_and_leaks_nothing(monkeypatch, tokenizer, engine_out, era):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        ex = executor_of(server)
        call = stub.Generate(request(stopping={"max_new_tokens": 400, "ignore_eos": True}))
        got = 0
        async for m in call:
            got += sum(len(o.tokens) for o in m.outputs)
            if got >= 3:
                break
        call.cancel()
        rid = max(ex.fake_requests)
        await wait_for(lambda: rid in ex.fake_cancel_calls)
        await wait_for(lambda: ex.fake_live_count == 0)
        await wait_for(lambda: not server.engine._live)
        await wait_idle(server.engine)
        assert ex.fake_cancel_calls.count(rid) == 1


async def test_engine_level_cancel_ends_with_cancelled(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    config = core_config(engine_out(), engine="trtllm")
    engine = trtllm.build(config, tokenizer)
    await engine.start()
    try:
        req = EngineRequest(
            "c1",
            tokenizer.encode("hi"),
            engine.resolve_sampling(SamplingOptions(), random_seed=1),
            400,
            ignore_eos=True,
        )
        outs = []
        async for out in engine.generate(req):
            outs.append(out)
            if any(s.token_ids for s in out.sequences) and len(outs) == 3:
                engine.abort("c1")
        assert outs[-1].finished
        assert outs[-1].sequences[-1].finish_reason.name == "CANCELLED"
        assert engine.stats().active == 0
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------------- errors, health


async def test_prompt_too_long_fails_before_any_message(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(max_input_len=32), tokenizer, engine="trtllm") as (server, stub):
        assert (await stub.GetModelInfo(spb.GetModelInfoRequest())).max_input_tokens == 32
        call = stub.Generate(spb.GenerateRequest(token_ids=pb.TokenIds(ids=[100] * 33)))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).reason == "CONTEXT_LENGTH_EXCEEDED"
        assert executor_of(server).fake_requests == {}


async def test_error_response_maps_to_invalid_argument(monkeypatch, tokenizer, engine_out):
    # max_utilization + streaming + no chunked context rejects prompt + max_tokens - 1 >
    # max_input_len with an error Response (after the request was queued).
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(
        trtllm.build, engine_out(max_input_len=32), tokenizer, engine="trtllm", trt_scheduler_policy="max_utilization"
    ) as (server, stub):
        msgs = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for m in stub.Generate(request(stopping={"max_new_tokens": 40})):
                msgs.append(m)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "stopping.max_new_tokens"
        assert [m.state for m in msgs] == [pb.GENERATE_STATE_QUEUED]
        await wait_for(lambda: not server.engine._live)


async def test_forward_failure_is_internal(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        call = stub.Generate(request(stopping={"max_new_tokens": 400, "ignore_eos": True}))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for m in call:
                if any(o.tokens for o in m.outputs):
                    executor_of(server).fake_fail_forward()
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "forwardAsync" in e.value.details()
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
        assert status == health_pb2.HealthCheckResponse.SERVING  # one failed step does not kill the engine


async def test_dead_executor_flips_health(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        call = stub.Generate(request(stopping={"max_new_tokens": 400, "ignore_eos": True}))
        await call.read()
        executor_of(server).fake_kill()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read_rest(call)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        await wait_health(server.address, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert GatewayError.from_rpc_error(e.value).reason == "ENGINE_DEAD"


# --------------------------------------------------------------------------------- lifecycle, info


async def test_request_stats_give_scheduled_before_tokens(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    config = core_config(
        engine_out(),
        engine="trtllm",
        trt_request_stats_max_iterations=1000,
        trt_enable_chunked_context=True,
        trt_max_num_tokens=4,
    )
    engine = trtllm.build(config, tokenizer)
    await engine.start()
    try:
        prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
        req = EngineRequest("s1", prompt, engine.resolve_sampling(SamplingOptions(), random_seed=1), 2)
        outs = [o async for o in engine.generate(req)]
        marks = [(o.state, bool(o.sequences)) for o in outs if o.state is not None or o.sequences]
        assert marks[0] == (RequestState.QUEUED, False)
        assert marks[1] == (RequestState.SCHEDULED, False)
        assert (RequestState.PREFILLED, True) in marks or (RequestState.PREFILLED, False) in marks
        first_tokens = next(i for i, (_, has) in enumerate(marks) if has)
        assert first_tokens > 1
    finally:
        await engine.shutdown()


async def test_model_info_reports_trtllm_defaults(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "0.15")
    async with serve_engine(trtllm.build, engine_out(max_seq_len=300), tokenizer, engine="trtllm") as (_server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert info.engine == "trtllm" and info.max_context_length == 300 and info.max_num_beams == 1
        assert info.max_input_tokens == 256  # the engine's max_input_len
        g, s = info.greedy_defaults, info.sampling_defaults
        assert not g.do_sample and g.temperature == pytest.approx(0.8)
        assert not g.HasField("top_k") and not g.HasField("top_p")
        assert s.do_sample and s.top_k == 5 and s.top_p == pytest.approx(0.85) and s.temperature == pytest.approx(1.0)
        assert set(info.unsupported_sampling_fields) == {"typical_p", "min_p"}  # 0.15 has no min_p
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(sampling={"do_sample": True, "min_p": 0.1}))
        assert GatewayError.from_rpc_error(e.value).param == "sampling.min_p"


async def test_session_continues_from_the_generated_tokens(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        first = await collect(stub, request(session_id="s", stopping={"max_new_tokens": 3}))
        await collect(stub, spb.GenerateRequest(session_id="s", stopping=pb.StoppingParams(max_new_tokens=2)))
        prompt = tokenizer.encode("hello")
        assert sent(server).input_token_ids == prompt + tokens_of(first)


async def test_shutdown_stops_executor_and_awaiter(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        await collect(stub, request(stopping={"max_new_tokens": 2}))
        engine = server.engine
    assert not engine.alive
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="Shutdown"):
        engine._executor.enqueue_request(None)


# --------------------------------------------------------------------------------- start-up


async def test_start_checks_engine_and_options(monkeypatch, tokenizer, tmp_path, tiny_model_dir):
    trtllm_executor.install(monkeypatch, "1.0")
    multi = make_engine_output(tmp_path / "tp2", tiny_model_dir, tp=2)
    engine = trtllm.build(core_config(multi, engine="trtllm"), tokenizer)
    with pytest.raises(RuntimeError, match="mpirun -n 2"):
        await engine.start()
    plain = make_engine_output(tmp_path / "nofmha", tiny_model_dir, use_paged_context_fmha=False)
    engine = trtllm.build(core_config(plain, engine="trtllm", trt_enable_chunked_context=True), tokenizer)
    with pytest.raises(RuntimeError, match="paged context FMHA"):
        await engine.start()
    engine = trtllm.build(core_config(plain, engine="trtllm"), tokenizer)
    await engine.start()  # block reuse (on by default) is turned off for this engine
    try:
        assert engine._executor.config.kv_cache_config.enable_block_reuse is False
    finally:
        await engine.shutdown()
    with pytest.raises(RuntimeError, match="not a TensorRT-LLM engine directory"):
        trtllm.build(core_config(tiny_model_dir, engine="trtllm"), tokenizer)


def test_missing_tensorrt_llm_names_the_extra(monkeypatch, tokenizer, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(RuntimeError, match=r"pip install 'trellis\[trtllm\]'"):
        trtllm.build(core_config(tiny_model_dir, engine="trtllm"), tokenizer)


def test_release_without_executor_points_to_trtllm_llm(monkeypatch, tokenizer, engine_out):
    trtllm_llm.install(monkeypatch, version="1.3.0")
    with pytest.raises(RuntimeError, match="--engine trtllm-llm"):
        trtllm.build(core_config(engine_out(), engine="trtllm"), tokenizer)


def test_follower_rank_waits_for_the_leader(monkeypatch, tmp_path, tiny_model_dir):
    out = make_engine_output(tmp_path / "tp2", tiny_model_dir, tp=2)
    tl = trtllm_executor.install(monkeypatch, "1.0", rank=1)
    mpi = types.ModuleType("mpi4py")
    mpi.MPI = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Get_rank=lambda: 1, Get_size=lambda: 2))
    monkeypatch.setitem(sys.modules, "mpi4py", mpi)
    result = []
    worker = threading.Thread(target=lambda: result.append(trtllm.run_if_follower_rank(core_config(out))))
    worker.start()
    tl.fake_follower_waiting.wait()
    assert worker.is_alive() and result == []  # blocked in shutdown() until the leader stops
    assert tl.fake_instances and not tl.fake_instances[0].can_enqueue_requests()
    tl.fake_leader_shutdown.set()
    worker.join()
    assert result == [True]
    mpi.MPI.COMM_WORLD.Get_rank = lambda: 0
    assert trtllm.run_if_follower_rank(core_config(out)) is False


async def test_engine_refuses_before_start_duplicates_and_non_leader(monkeypatch, tokenizer, engine_out, caplog):
    trtllm_executor.install(monkeypatch, "1.0")
    engine = trtllm.build(core_config(engine_out(), engine="trtllm"), tokenizer)
    req = EngineRequest(
        "d#1", tokenizer.encode("hi"), engine.resolve_sampling(SamplingOptions(), random_seed=1), 300, ignore_eos=True
    )
    with pytest.raises(NotReady):
        await engine.generate(req).__anext__()
    await engine.start()
    gen = engine.generate(req)
    await gen.__anext__()
    with pytest.raises(InvalidArgument, match="already running"):
        await engine.generate(req).__anext__()
    live = engine._by_name["d#1"]
    engine._executor.fake_kill()
    engine._cancel(live)  # the executor refuses now: logged, not raised
    assert "cancel_request" in caplog.text

    def refuse():
        raise RuntimeError("dead")

    monkeypatch.setattr(engine._executor, "shutdown", refuse)
    await engine.shutdown()  # a dead executor's refusal to shut down is logged too
    assert "executor shutdown: dead" in caplog.text and not engine.alive
    await gen.aclose()

    trtllm_executor.install(monkeypatch, "1.0", rank=1)  # a rank that cannot enqueue, without mpirun
    engine = trtllm.build(core_config(engine_out(), engine="trtllm"), tokenizer)
    with pytest.raises(RuntimeError, match="only MPI rank 0 serves gRPC"):
        await engine.start()


async def test_time_limit_ends_a_request_stuck_in_the_queue(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        ex = executor_of(server)
        ex.fake_pause()
        try:
            msgs = await collect(stub, request(stopping={"max_new_tokens": 4, "time_limit_ms": 100}))
            assert finish_of(msgs).finish_reason == pb.FINISH_REASON_TIME_LIMIT
            assert not tokens_of(msgs) and msgs[-1].usage.completion_tokens == 0
        finally:
            ex.fake_resume()
