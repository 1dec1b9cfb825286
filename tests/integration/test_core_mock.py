"""The core on the mock engine (`--engine mock`) over real gRPC on loopback, through the real
request pipeline, a gateway, and the `trellis-core` process."""

from __future__ import annotations

import asyncio
import signal

import grpc
import openai
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.types import EngineStats
from tests.integration.core_helpers import (
    FINISH,
    bad_request_field,
    generate,
    request,
    sequences,
    start_core_process,
    wait_idle,
)


def body(text: str = "Once upon a time", max_new: int = 12, **extra) -> dict:
    b: dict = {"text": text, "stopping": {"maxNewTokens": max_new}}
    for k, v in extra.items():
        b[k] = {**b.get(k, {}), **v} if isinstance(v, dict) else v
    return b


@pytest.fixture(scope="module")
async def stub(mock_core):
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        yield spb_grpc.GenerateServiceStub(channel)


async def open_stub(address: str) -> tuple[grpc.aio.Channel, spb_grpc.GenerateServiceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, spb_grpc.GenerateServiceStub(channel)


async def test_model_info_names_the_mock_engine(stub, mock_core):
    info = await stub.GetModelInfo(spb.GetModelInfoRequest())
    assert (info.engine, info.model_name) == ("mock", "mock")
    assert info.max_context_length == mock_core.engine.info.max_context_length
    assert info.max_input_tokens == info.max_context_length - 1
    assert info.max_top_logprobs == 20 and info.max_num_beams == 1


async def test_stream_carries_the_lifecycle_text_and_usage(stub, mock_core):
    msgs = await generate(stub, body(max_new=9))
    states = [m.state for m in msgs if m.state]
    assert states == [
        pb.GENERATE_STATE_QUEUED,
        pb.GENERATE_STATE_SCHEDULED,
        pb.GENERATE_STATE_PREFILLED,
        pb.GENERATE_STATE_GENERATING,
    ]
    seq = sequences(msgs)[0]
    assert len(seq["ids"]) == 9 and seq["finish"] == FINISH.FINISH_REASON_LENGTH
    tok = mock_core.servicer.pipeline.tokenizer
    assert seq["text"] == tok.decode(seq["ids"]) and all(t.text for t in seq["tokens"])
    assert msgs[-1].usage.completion_tokens == 9 and msgs[-1].timing.total_ms > 0


async def test_seeded_output_is_the_same_alone_and_in_a_full_batch(stub):
    seeded = body(max_new=24, sampling={"seed": 42, "doSample": True})
    alone = sequences(await generate(stub, seeded))[0]
    crowd = [body(f"prompt {i}", max_new=30, sampling={"seed": i, "doSample": True}) for i in range(20)]
    results = await asyncio.gather(generate(stub, seeded), *(generate(stub, b) for b in crowd))
    again = sequences(results[0])[0]
    assert (again["ids"], again["text"]) == (alone["ids"], alone["text"])
    assert results[0][-1].seed == 42
    other = sequences(await generate(stub, body(max_new=24, sampling={"seed": 43, "doSample": True})))[0]
    assert other["ids"] != alone["ids"]
    greedy = [sequences(m)[0]["ids"] for m in await asyncio.gather(generate(stub, body()), generate(stub, body()))]
    assert greedy[0] == greedy[1]


async def test_a_batch_larger_than_max_batch_size_runs_at_most_that_many_at_once(start_mock_core):
    core = await start_mock_core(max_batch_size=3)
    channel, stub = await open_stub(core.address)
    seen: list[EngineStats] = []

    async def run(i: int) -> list[spb.GenerateResponse]:
        msgs = []
        async for m in stub.Generate(request(body(f"p{i}", max_new=6))):
            seen.append(core.engine.stats())
            msgs.append(m)
        return msgs

    try:
        results = await asyncio.gather(*(run(i) for i in range(8)))
    finally:
        await channel.close()
        await core.stop(0)
    assert max(s.active for s in seen) == 3 and max(s.queued for s in seen) >= 1
    assert all(sequences(msgs)[0]["finish"] == FINISH.FINISH_REASON_LENGTH for msgs in results)
    assert all(msgs[-1].usage.completion_tokens == 6 for msgs in results)
    assert max(msgs[-1].timing.queue_ms for msgs in results) > 0


async def test_cancelling_the_call_aborts_the_engine_request_and_frees_its_slot(start_mock_core):
    core = await start_mock_core(max_batch_size=1, mock_step_ms=5.0)
    channel, stub = await open_stub(core.address)
    try:
        running = stub.Generate(request(body(max_new=1000)))
        while (await running.read()).state != pb.GENERATE_STATE_GENERATING:
            pass
        waiting = stub.Generate(request(body(max_new=3)))
        assert (await waiting.read()).state == pb.GENERATE_STATE_QUEUED
        before = core.engine.steps
        running.cancel()
        rest = []
        while (m := await waiting.read()) is not grpc.aio.EOF:
            rest.append(m)
        assert sequences(rest)[0]["finish"] == FINISH.FINISH_REASON_LENGTH
        await wait_idle(core.engine)
        assert core.engine.steps - before < 100  # aborted, far from running to max_new_tokens
    finally:
        await channel.close()
        await core.stop(0)


async def test_full_queue_is_resource_exhausted_before_any_message(start_mock_core):
    core = await start_mock_core(max_batch_size=1, max_queue_size=1)
    channel, stub = await open_stub(core.address)
    try:
        running = stub.Generate(request(body(max_new=1000)))
        while (await running.read()).state != pb.GENERATE_STATE_GENERATING:
            pass
        waiting = stub.Generate(request(body(max_new=1)))
        assert (await waiting.read()).state == pb.GENERATE_STATE_QUEUED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, body())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.cancel()
        last = None
        while (m := await waiting.read()) is not grpc.aio.EOF:
            last = m
        assert last is not None and last.usage.completion_tokens == 1
        await wait_idle(core.engine)
    finally:
        await channel.close()
        await core.stop(0)


async def test_eos_probability_min_new_tokens_and_ignore_eos(start_mock_core):
    core = await start_mock_core(mock_eos_probability=1.0)
    channel, stub = await open_stub(core.address)
    try:
        eos = sequences(await generate(stub, body()))[0]
        assert eos["finish"] == FINISH.FINISH_REASON_EOS and len(eos["ids"]) == 1 and eos["text"] == ""
        floor = await generate(stub, body(stopping={"minNewTokens": 4}))
        assert sequences(floor)[0]["finish"] == FINISH.FINISH_REASON_EOS
        assert floor[-1].usage.completion_tokens == 5
        ignored = await generate(stub, body(max_new=7, stopping={"ignoreEos": True}))
        assert sequences(ignored)[0]["finish"] == FINISH.FINISH_REASON_LENGTH
        assert ignored[-1].usage.completion_tokens == 7
    finally:
        await channel.close()
        await core.stop(0)


async def test_stop_token_ids_stop_and_report_the_token(stub):
    seeded = {"seed": 9, "doSample": True}
    free = sequences(await generate(stub, body(max_new=30, sampling=seeded)))[0]["ids"]
    stop = free[4]
    msgs = await generate(stub, body(max_new=30, sampling=seeded, stopping={"stopTokenIds": [stop]}))
    seq = sequences(msgs)[0]
    assert seq["finish"] == FINISH.FINISH_REASON_STOP_SEQUENCE and seq["stop_id"] == stop
    assert seq["ids"] == free[: free.index(stop) + 1]


async def test_n_best_of_and_logprobs(stub):
    msgs = await generate(
        stub, body(max_new=8, sampling={"n": 3, "seed": 5, "doSample": True}, output={"logprobs": True})
    )
    seqs = sequences(msgs)
    assert sorted(seqs) == [0, 1, 2] and len({tuple(s["ids"]) for s in seqs.values()}) == 3
    assert msgs[-1].usage.completion_tokens == 24
    best = await generate(stub, body(max_new=8, sampling={"n": 1, "bestOf": 3, "seed": 5, "doSample": True}))
    assert list(sequences(best)) == [0] and best[-1].usage.completion_tokens == 8
    top = await generate(stub, body(max_new=8, sampling={"seed": 5}, output={"logprobs": True, "topLogprobs": 4}))
    seq = sequences(top)[0]
    assert seq["cumulative"] == pytest.approx(sum(t.logprob for t in seq["tokens"]), abs=1e-3)
    for t in seq["tokens"]:
        values = [a.logprob for a in t.top_logprobs]
        assert t.logprob <= 0 and len(values) == 4 and values == sorted(values, reverse=True)
        if t.id in [a.id for a in t.top_logprobs]:
            assert next(a.logprob for a in t.top_logprobs if a.id == t.id) == t.logprob


async def test_prompt_logprobs_and_context_length(start_mock_core, stub):
    prompt = {"tokenIds": {"ids": [1, 40, 41, 42]}, "stopping": {"maxNewTokens": 2}}
    msgs = await generate(stub, {**prompt, "output": {"promptLogprobs": 2}})
    prefilled = next(m for m in msgs if m.state == pb.GENERATE_STATE_PREFILLED)
    assert [t.id for t in prefilled.prompt_tokens] == [1, 40, 41, 42]
    assert not prefilled.prompt_tokens[0].HasField("logprob")
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in prefilled.prompt_tokens[1:])
    core = await start_mock_core(mock_context_length=16)
    channel, small = await open_stub(core.address)
    try:
        ids = list(range(100, 110))
        fit = await generate(small, {"tokenIds": {"ids": ids}})  # max_new_tokens unset: lowered to fit the context
        assert fit[-1].usage.completion_tokens == 6
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(small, {"tokenIds": {"ids": ids}, "stopping": {"maxNewTokens": 7}})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_field(e.value) == "stopping.max_new_tokens"
        # The longest prompt GetModelInfo reports is served; one token more is refused.
        longest = (await small.GetModelInfo(spb.GetModelInfoRequest())).max_input_tokens
        assert longest == 15
        fit = await generate(small, {"tokenIds": {"ids": list(range(100, 100 + longest))}})
        assert fit[-1].usage.completion_tokens == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(small, {"tokenIds": {"ids": list(range(100, 101 + longest))}})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_field(e.value) == "token_ids"
    finally:
        await channel.close()
        await core.stop(0)


async def test_openai_gateway_streams_every_token_from_the_mock_core(start_gateway, mock_core):
    url = await start_gateway("openai", core=mock_core.address)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="mock",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
        chunks = [c async for c in stream]
    finally:
        await client.close()
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 16  # every mock token is whole text: one chunk per token
    assert chunks[-1].usage.completion_tokens == 16
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(logprobs) == 16 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


async def test_trellis_core_process_serves_a_tokenizer_only_directory(tokenizer_only_dir):
    proc, address = await start_core_process("--engine", "mock", "--model", str(tokenizer_only_dir), "--port", "0")
    try:
        channel, stub = await open_stub(address)
        async with channel:
            info = await stub.GetModelInfo(spb.GetModelInfoRequest())
            msgs = await generate(stub, body(max_new=5))
        assert (info.engine, info.max_context_length) == ("mock", 4096)
        assert msgs[-1].usage.completion_tokens == 5
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_tokens_false_streams_the_same_text_without_token_details(stub):
    with_tokens = await generate(stub, body(max_new=20))
    text_only = await generate(stub, body(max_new=20, output={"tokens": False}))
    assert all(not o.tokens for m in text_only for o in m.outputs)
    assert sequences(text_only)[0]["text"] == sequences(with_tokens)[0]["text"]
    assert text_only[-1].usage.completion_tokens == with_tokens[-1].usage.completion_tokens == 20
    assert [m.state for m in text_only if m.state] == [m.state for m in with_tokens if m.state]
    with pytest.raises(grpc.RpcError) as info:
        await generate(stub, body(output={"tokens": False, "logprobs": True}))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_field(info.value) == "output.tokens"
