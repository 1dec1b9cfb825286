"""`--engine trtllm-llm` against the LLM API double, through the real core and gRPC on loopback."""

from __future__ import annotations

import sys
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.engine.trtllm import llm as trtllm_llm
from core.errors import InvalidArgument, NotReady
from core.types import EngineRequest, ResolvedSampling, SamplingOptions
from gateways.common.status import GatewayError
from tests.conftest import core_config
from tests.fakes import trtllm_executor
from tests.fakes import trtllm_llm as fake_llm
from tests.fakes.trtllm_harness import collect, finish_of, serve_engine, text_of, tokens_of
from tests.fakes.trtllm_model import FakeModel
from tests.integration.core_helpers import request_of as request
from tests.integration.core_helpers import wait_for, wait_health

MODEL = FakeModel(4096)


@pytest.fixture
def fake(monkeypatch):
    return fake_llm.install(monkeypatch)


def llm_of(fake):
    return fake.fake_instances[-1]


def sent(fake):
    requests = llm_of(fake).fake_executor.fake_requests
    return requests[max(requests)]


async def read_rest(call) -> list:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def test_streams_greedy_tokens(fake, tokenizer, tiny_model_dir):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 7}))
        expected, _ = MODEL.greedy(tokenizer.encode("hello"), 7)
        assert tokens_of(msgs) == expected and text_of(msgs) == tokenizer.decode(expected)
        assert [m.state for m in msgs if m.state] == [
            pb.GENERATE_STATE_QUEUED,
            pb.GENERATE_STATE_SCHEDULED,
            pb.GENERATE_STATE_PREFILLED,
            pb.GENERATE_STATE_GENERATING,
        ]
        assert sum(1 for m in msgs if any(o.tokens for o in m.outputs)) >= 2
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH
        llm = llm_of(fake)
        # guided decoding (on by default) needs the LLM's tokenizer: llm_kwargs loads it
        assert not llm.args.skip_tokenizer_init and llm.args.tokenizer == str(tiny_model_dir)
        assert llm.fake_guided_backend == "xgrammar"
        assert llm.args.kv_cache_config.enable_block_reuse is True
        r = sent(fake)
        assert r.end_id == 2 and r.pad_id == 0 and r.streaming and r.stop_words == [[7]]
        sc = r.sampling_config
        assert (sc.top_k, sc.top_p, sc.temperature) == (None, None, None) and sc.seed == msgs[-1].seed
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert info.engine == "trtllm-llm" and info.max_context_length == 1024
        assert info.greedy_defaults.temperature == pytest.approx(0.8) and info.sampling_defaults.top_k == 5


async def test_sampling_defaults_are_shared(fake, tokenizer, tiny_model_dir):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(stub, request(sampling={"do_sample": True}, stopping={"max_new_tokens": 3}))
        eff = msgs[-1].effective_sampling
        assert (eff.top_k, round(eff.top_p, 4), eff.temperature) == (5, 0.85, 1.0)
        sc = sent(fake).sampling_config
        assert (sc.top_k, round(sc.top_p, 4), sc.temperature) == (5, 0.85, 1.0)
        await collect(stub, request(sampling={"do_sample": True, "temperature": 0.0}, stopping={"max_new_tokens": 2}))
        sc = sent(fake).sampling_config
        assert (sc.top_k, sc.top_p, sc.temperature) == (None, None, None)


async def test_stop_token_eos_and_extra_eos(fake, tokenizer, tiny_model_dir):
    greedy, _ = MODEL.greedy(tokenizer.encode("hello"), 10)
    i = next(k for k in range(2, 10) if greedy[k] not in greedy[:k])
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 10, "stop_token_ids": [greedy[i]]}))
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and last.stop_token_id == greedy[i]
        assert tokens_of(msgs) == greedy[: i + 1] and text_of(msgs) == tokenizer.decode(greedy[:i])
        msgs = await collect(stub, request(bias={2: 100.0}, stopping={"max_new_tokens": 10}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS and len(tokens_of(msgs)) == 1
        msgs = await collect(stub, request(bias={7: 100.0}, stopping={"max_new_tokens": 10}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS and tokens_of(msgs) == [7]
        msgs = await collect(stub, request(bias={2: 100.0}, stopping={"max_new_tokens": 3, "ignore_eos": True}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH and tokens_of(msgs) == [2, 2, 2]
        assert sent(fake).end_id == -1


async def test_stop_string_aborts_the_request(fake, tokenizer, tiny_model_dir):
    greedy, _ = MODEL.greedy(tokenizer.encode("hello"), 12)
    full = tokenizer.decode(greedy)
    p = len(tokenizer.decode(greedy[:4]))
    stop = full[p : p + 2]
    assert full.find(stop) == p and stop.strip()
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 12, "stop": [stop]}))
        assert finish_of(msgs).stop_sequence == stop and text_of(msgs) == full[:p]
        ex = llm_of(fake).fake_executor
        await wait_for(lambda: ex.fake_live_count == 0)
        assert max(ex.fake_requests) in ex.fake_cancel_calls
        assert server.engine.stats().active == 0


async def test_n_logprobs_and_refusals(fake, tokenizer, tiny_model_dir):
    prompt = tokenizer.encode("hello")
    expected, lps = MODEL.greedy(prompt, 5)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(
            stub, request(sampling={"n": 2, "do_sample": True, "seed": 3}, stopping={"max_new_tokens": 4})
        )
        assert {o.index for m in msgs for o in m.outputs} == {0, 1}
        assert all(finish_of(msgs, i).finish_reason == pb.FINISH_REASON_LENGTH for i in (0, 1))
        msgs = await collect(stub, request(stopping={"max_new_tokens": 5}, output={"logprobs": True}))
        assert tokens_of(msgs) == expected
        assert [t.logprob for m in msgs for o in m.outputs for t in o.tokens] == pytest.approx(lps, abs=1e-4)
        for body, param in [
            (request(sampling={"n": 2}), "sampling.n"),
            (request(output={"logprobs": True, "top_logprobs": 1}), "output.top_logprobs"),
            (request(output={"prompt_logprobs": 0}), "output.prompt_logprobs"),
            (request(sampling={"bad_words": ["hello world again"]}), "sampling.bad_words"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, body)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert GatewayError.from_rpc_error(e.value).param == param


async def test_queue_full_and_cancel(fake, tokenizer, tiny_model_dir):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm", max_queue_size=1) as (
        server,
        stub,
    ):
        ex = llm_of(fake).fake_executor
        ex.fake_pause()
        first = stub.Generate(request(stopping={"max_new_tokens": 300, "ignore_eos": True}))
        assert (await first.read()).state == pb.GENERATE_STATE_QUEUED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ex.fake_resume()
        while not any(o.tokens for o in (await first.read()).outputs):
            pass
        first.cancel()
        rid = max(ex.fake_requests)
        await wait_for(lambda: rid in ex.fake_cancel_calls)
        await wait_for(lambda: ex.fake_live_count == 0)
        await wait_for(lambda: not server.engine._live)


async def test_errors_and_dead_worker(fake, tokenizer, tiny_model_dir):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        # A per-request error Response becomes RequestError: prompt too long -> INVALID_ARGUMENT.
        llm_of(fake).fake_executor._max_input_len = 4
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request("a much longer prompt than four tokens"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        llm_of(fake).fake_executor._max_input_len = 1024
        call = stub.Generate(request(stopping={"max_new_tokens": 300, "ignore_eos": True}))
        while not (await call.read()).outputs:  # the failure must hit the request while it runs
            pass
        llm_of(fake).fake_executor.fake_fail_forward()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read_rest(call)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        llm_of(fake).fake_kill()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.INTERNAL
        await wait_health(server.address, health_pb2.HealthCheckResponse.NOT_SERVING)


def test_build_refuses_engine_dirs_and_missing_package(monkeypatch, tokenizer, tiny_model_dir, tmp_path):
    from tests.fakes.trtllm_executor import write_engine_dir

    fake_llm.install(monkeypatch)
    engine_dir = write_engine_dir(tmp_path / "engine")
    with pytest.raises(RuntimeError, match="--engine trtllm"):
        trtllm_llm.build(core_config(engine_dir, engine="trtllm-llm", tokenizer=str(tiny_model_dir)), tokenizer)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(RuntimeError, match=r"pip install 'trellis\[trtllm\]'"):
        trtllm_llm.build(core_config(tiny_model_dir, engine="trtllm-llm"), tokenizer)


async def test_shutdown_aborts_live_requests(fake, tokenizer, tiny_model_dir):
    engine = trtllm_llm.build(core_config(tiny_model_dir, engine="trtllm-llm"), tokenizer)
    await engine.start()
    req = EngineRequest(
        "x#1", tokenizer.encode("hi"), engine.resolve_sampling(SamplingOptions(), random_seed=1), 300, ignore_eos=True
    )
    gen = engine.generate(req)
    while not (await gen.__anext__()).sequences:
        pass
    ex = llm_of(fake).fake_executor
    await engine.shutdown()
    assert max(ex.fake_requests) in ex.fake_cancel_calls and not engine.alive
    await gen.aclose()
    with pytest.raises(NotReady):
        await engine.generate(req).__anext__()


async def test_submit_failures(fake, tokenizer, tiny_model_dir):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        llm_of(fake).fake_fail_submit(ValueError("prompt_token_ids must not be empty"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must not be empty" in e.value.details()
        llm_of(fake).fake_fail_submit(RuntimeError("request queue is full"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.engine.alive
        # Values core validation would stop still get the LLM API's own answer at engine level.
        bad = EngineRequest("v#1", [1, 5], ResolvedSampling(do_sample=True, seed=1, top_p=1.5), 4)
        with pytest.raises(InvalidArgument, match="top_p"):
            await server.engine.generate(bad).__anext__()
        ok = EngineRequest(
            "d#1", [1, 5], server.engine.resolve_sampling(SamplingOptions(), random_seed=1), 300, ignore_eos=True
        )
        gen = server.engine.generate(ok)
        await gen.__anext__()
        with pytest.raises(InvalidArgument, match="already running"):
            await server.engine.generate(ok).__anext__()
        await gen.aclose()


def test_engines_need_an_eos_token(fake, tiny_model_dir):
    no_eos = types.SimpleNamespace(
        hf=types.SimpleNamespace(eos_token_id=None), eos_token_ids=frozenset(), pad_token_id=None, vocab_size=4096
    )
    with pytest.raises(RuntimeError, match="no EOS token"):
        trtllm_llm.build(core_config(tiny_model_dir, engine="trtllm-llm"), no_eos)
    with pytest.raises(RuntimeError, match=r"no config\.json"):
        trtllm_llm.build(core_config(tiny_model_dir / "missing", engine="trtllm-llm"), no_eos)
    layout = trtllm.EngineLayout(
        engine_dir=tiny_model_dir,
        max_input_len=8,
        max_seq_len=16,
        max_batch_size=1,
        max_beam_width=1,
        max_num_tokens=None,
        vocab_size=4096,
    )
    with pytest.raises(RuntimeError, match="no EOS token"):
        trtllm.TrtllmEngine(trtllm_executor.make_module("1.0"), layout, no_eos, trtllm.TrtllmOptions())


async def test_a_request_output_that_ends_without_a_final_update_is_internal(fake, tokenizer, tiny_model_dir):
    class EndsEarly:  # a RequestOutput whose updates stop before one says finished
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        def abort(self):
            pass

    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        llm_of(fake).generate_async = lambda *args, **kwargs: EndsEarly()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.INTERNAL and "without finishing" in e.value.details()
        assert server.engine.alive and not server.engine._live


async def test_a_bug_reading_an_update_fails_the_request_not_the_engine(fake, tokenizer, tiny_model_dir, monkeypatch):
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):

        def broken(live, ro):
            raise KeyError("sequence_index")

        monkeypatch.setattr(server.engine, "_read", broken)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request())
        assert e.value.code() == grpc.StatusCode.INTERNAL and "Cannot read the LLM's output" in e.value.details()
        ex = llm_of(fake).fake_executor
        assert server.engine.alive and max(ex.fake_requests) in ex.fake_cancel_calls
