"""The core over real gRPC on loopback (HF engine, tiny model)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.server import start_core
from tests.conftest import core_config
from tests.integration.core_helpers import bad_request_field, generate, request, sequences, wait_for, wait_idle

GREEDY = {"stopping": {"maxNewTokens": 12, "ignoreEos": True}}


def body(prompt: str = "def __init__(self", **extra):
    b = {"text": prompt, **GREEDY}
    for k, v in extra.items():
        b[k] = {**b.get(k, {}), **v} if isinstance(v, dict) else v
    return b


async def test_stream_order_lifecycle_then_deltas_then_final(stub):
    msgs = await generate(stub, body())
    states = [m.state for m in msgs if m.state]
    assert states == [
        pb.GENERATE_STATE_QUEUED,
        pb.GENERATE_STATE_SCHEDULED,
        pb.GENERATE_STATE_PREFILLED,
        pb.GENERATE_STATE_GENERATING,
    ]
    first_token = next(i for i, m in enumerate(msgs) if any(o.tokens for o in m.outputs))
    assert msgs[first_token].state == pb.GENERATE_STATE_GENERATING
    assert all(not m.outputs for m in msgs[:first_token])
    assert [m.HasField("usage") for m in msgs].count(True) == 1 and msgs[-1].HasField("usage")
    final = msgs[-1]
    assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens > 0
    assert final.HasField("seed") and final.effective_sampling.do_sample is False
    assert final.timing.total_ms >= final.timing.prefill_ms >= 0
    assert len({m.request_id for m in msgs}) == 1
    assert sequences(msgs)[0]["finish"] == pb.FINISH_REASON_LENGTH


async def test_request_id_is_echoed(stub):
    msgs = await generate(stub, body(requestId="my-id-1"))
    assert {m.request_id for m in msgs} == {"my-id-1"}


async def test_concatenated_deltas_equal_the_decoded_sequence(stub, tokenizer):
    for prompt in ("x", "Hello world", "中文 😀"):
        seq = sequences(await generate(stub, body(prompt, stopping={"maxNewTokens": 24})))[0]
        assert seq["text"] == tokenizer.decode(seq["ids"])
        assert "\ufffd" not in seq["text"] or "\ufffd" in tokenizer.decode(seq["ids"])


async def test_greedy_equals_transformers_generate(stub, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for prompt in ("def __init__(self", "The quick brown"):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(ids) :]
        # batch companions must not change the result
        ours, *_ = await asyncio.gather(
            generate(stub, {"text": prompt, "stopping": {"maxNewTokens": 20}}),
            *(generate(stub, body(p, stopping={"maxNewTokens": 30})) for p in ("a", "bb bb", "longer prompt here x y")),
        )
        assert sequences(ours)[0]["ids"] == ref.tolist()


async def test_seeded_sampling_is_reproducible_across_runs_and_batch_companions(stub):
    sampled = body(
        "import os",
        sampling={"doSample": True, "temperature": 1.3, "topP": 0.95, "seed": 1234},
        stopping={"maxNewTokens": 24},
    )
    alone = sequences(await generate(stub, sampled))[0]["ids"]
    again = sequences(await generate(stub, sampled))[0]["ids"]
    companions = [
        body(p, sampling={"doSample": True, "temperature": t, "seed": s}, stopping={"maxNewTokens": n})
        for p, t, s, n in (("zz", 0.7, 1, 30), ("a b c d e f", 1.5, 2, 8), ("q", 1.0, 3, 40))
    ]
    crowded, *_ = await asyncio.gather(generate(stub, sampled), *(generate(stub, c) for c in companions))
    assert alone == again == sequences(crowded)[0]["ids"]
    other_seed = body(
        "import os",
        sampling={"doSample": True, "temperature": 1.3, "topP": 0.95, "seed": 99},
        stopping={"maxNewTokens": 24},
    )
    assert sequences(await generate(stub, other_seed))[0]["ids"] != alone


async def test_unseeded_requests_get_distinct_reported_seeds(stub):
    finals = [(await generate(stub, body(sampling={"doSample": True})))[-1] for _ in range(2)]
    assert finals[0].seed != finals[1].seed


async def test_n_sequences(stub):
    msgs = await generate(stub, body(sampling={"n": 3, "doSample": True, "seed": 5}))
    seqs = sequences(msgs)
    assert sorted(seqs) == [0, 1, 2]
    assert all(s["finish"] == pb.FINISH_REASON_LENGTH and len(s["ids"]) == 12 for s in seqs.values())
    assert len({tuple(s["ids"]) for s in seqs.values()}) > 1
    assert msgs[-1].usage.completion_tokens == 36


async def test_best_of_returns_the_n_most_likely(stub):
    msgs = await generate(
        stub, body(sampling={"n": 1, "bestOf": 3, "doSample": True, "seed": 5}, output={"logprobs": True})
    )
    token_msgs = [m for m in msgs if m.outputs]
    assert len(token_msgs) == 1 and token_msgs[0] is msgs[-1]  # buffered until done
    seqs = sequences(msgs)
    assert list(seqs) == [0] and len(seqs[0]["ids"]) == 12
    assert seqs[0]["cumulative"] == pytest.approx(sum(t.logprob for t in seqs[0]["tokens"]), abs=1e-3)


async def test_logprobs_and_top_logprobs(stub, tokenizer):
    seq = sequences(await generate(stub, body(output={"logprobs": True, "topLogprobs": 3})))[0]
    for t in seq["tokens"]:
        assert t.HasField("logprob") and t.logprob <= 0
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0
        assert t.top_logprobs[0].id == t.id  # greedy picks the most likely token
        assert t.bytes == tokenizer.token_bytes(t.id)
    assert seq["cumulative"] == pytest.approx(sum(t.logprob for t in seq["tokens"]), abs=1e-3)
    plain = sequences(await generate(stub, body()))[0]
    assert not any(t.HasField("logprob") or t.top_logprobs for t in plain["tokens"])


async def test_stop_strings(stub):
    full = sequences(await generate(stub, body(stopping={"maxNewTokens": 20})))[0]
    text = full["text"]
    stop = text[5:8]
    assert stop.strip(), "the greedy output is too short to pick a stop string"
    cut = text.index(stop)
    seq = sequences(await generate(stub, body(stopping={"stop": [stop], "maxNewTokens": 20})))[0]
    assert seq["text"] == text[:cut] and seq["finish"] == pb.FINISH_REASON_STOP_SEQUENCE and seq["stop"] == stop
    seq = sequences(
        await generate(stub, body(stopping={"stop": [stop], "includeStopStrInOutput": True, "maxNewTokens": 20}))
    )[0]
    assert seq["text"] == text[: cut + len(stop)]


async def test_stop_token_ids_and_eos(stub):
    full = sequences(await generate(stub, body()))[0]
    stop_id = full["ids"][3]
    first = full["ids"].index(stop_id)
    seq = sequences(await generate(stub, body(stopping={"stopTokenIds": [stop_id]})))[0]
    assert seq["finish"] == pb.FINISH_REASON_STOP_SEQUENCE and seq["stop_id"] == stop_id
    assert seq["ids"] == full["ids"][: first + 1]
    # force EOS (id 2) with a logit bias: EOS ends the sequence unless ignore_eos
    eos = {"sampling": {"logitBias": {"2": 100.0}}}
    seq = sequences(await generate(stub, {"text": "x", "stopping": {"maxNewTokens": 8}, **eos}))[0]
    assert seq["finish"] == pb.FINISH_REASON_EOS and seq["ids"] == [2] and seq["text"] == ""
    seq = sequences(await generate(stub, {"text": "x", "stopping": {"maxNewTokens": 3, "minNewTokens": 2}, **eos}))[0]
    assert len(seq["ids"]) == 3 and seq["ids"][-1] == 2 and seq["finish"] == pb.FINISH_REASON_EOS
    seq = sequences(await generate(stub, {"text": "x", "stopping": {"maxNewTokens": 4, "ignoreEos": True}, **eos}))[0]
    assert seq["ids"] == [2, 2, 2, 2] and seq["finish"] == pb.FINISH_REASON_LENGTH


async def test_logit_bias_and_bad_words(stub, tokenizer):
    full = sequences(await generate(stub, body()))[0]
    banned = tokenizer.decode([full["ids"][0]])
    seq = sequences(await generate(stub, body(sampling={"badWords": [banned]})))[0]
    assert full["ids"][0] not in seq["ids"]
    seq = sequences(await generate(stub, body(sampling={"logitBias": {"300": 100.0}})))[0]
    assert set(seq["ids"]) == {300}


async def test_echo_and_prompt_logprobs(stub, tokenizer):
    msgs = await generate(stub, body("Hello world", output={"echo": True, "promptLogprobs": 2}))
    assert msgs[0].state == pb.GENERATE_STATE_QUEUED and msgs[0].prompt_text == "Hello world"
    prefilled = next(m for m in msgs if m.state == pb.GENERATE_STATE_PREFILLED)
    ids = tokenizer.encode("Hello world")
    assert [t.id for t in prefilled.prompt_tokens] == ids
    assert not prefilled.prompt_tokens[0].HasField("logprob")
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in prefilled.prompt_tokens[1:])


async def test_chat_messages_use_the_chat_template(stub, tokenizer):
    chat = {
        "messages": {
            "messages": [
                {"role": "system", "content": [{"text": "be brief"}]},
                {"role": "user", "content": [{"text": "hi"}]},
            ]
        },
        **GREEDY,
    }
    msgs = await generate(stub, chat)
    expected = tokenizer.encode("<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>", add_special_tokens=False)
    assert msgs[-1].usage.prompt_tokens == len(expected)
    via_ids = await generate(stub, {"tokenIds": {"ids": expected}, **GREEDY})
    assert sequences(msgs)[0]["ids"] == sequences(via_ids)[0]["ids"]


async def test_truncate_input_tokens_and_time_limit(stub):
    msgs = await generate(stub, body("one two three four five six seven", stopping={"truncateInputTokens": 3}))
    assert msgs[-1].usage.prompt_tokens == 3
    msgs = await generate(stub, {"text": "x", "stopping": {"maxNewTokens": 500, "ignoreEos": True, "timeLimitMs": 1}})
    seq = sequences(msgs)[0]
    assert seq["finish"] == pb.FINISH_REASON_TIME_LIMIT and len(seq["ids"]) < 500


async def test_continue_generation_session(stub):
    one = sequences(await generate(stub, body("Once", stopping={"maxNewTokens": 16})))[0]["ids"]
    sid = f"sess-{random.random()}"
    first = await generate(stub, body("Once", stopping={"maxNewTokens": 8}, sessionId=sid))
    second = await generate(stub, body("ignored prompt", stopping={"maxNewTokens": 8}, sessionId=sid))
    assert first[0].session_continued is False and second[0].session_continued is True
    assert sequences(first)[0]["ids"] + sequences(second)[0]["ids"] == one
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, {"sessionId": f"missing-{random.random()}", **GREEDY})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_session_continues_on_its_cached_prompt_and_generates_the_same(stub, tokenizer):
    """A session's next request is its history as a prompt: the core's prefix cache (on by
    default) serves the full blocks of the sequence before (its prompt and the tokens it
    generated but the last: usage.cached_tokens), and the tokens are those of one uninterrupted
    request."""
    text = f"{random.random()} The lighthouse keeper wrote down every ship that passed the cape. " * 3
    prompt = len(tokenizer.encode(text))
    assert prompt > 32
    one = sequences(await generate(stub, body(text, stopping={"maxNewTokens": 16})))[0]["ids"]
    sid = f"sess-{random.random()}"
    first = await generate(stub, body(text, stopping={"maxNewTokens": 8}, sessionId=sid))
    second = await generate(stub, body("ignored", stopping={"maxNewTokens": 8}, sessionId=sid))
    assert first[-1].usage.cached_tokens == (prompt - 1) // 16 * 16  # the first request stored them
    assert second[-1].usage.prompt_tokens == prompt + 8
    assert second[-1].usage.cached_tokens == (prompt + 7) // 16 * 16
    assert sequences(first)[0]["ids"] + sequences(second)[0]["ids"] == one


async def test_a_session_that_ends_on_eos_is_deleted(stub):
    sid = f"eos-{random.random()}"
    await generate(stub, body("Once", sessionId=sid))
    eos = {"sampling": {"logitBias": {"2": 100.0}}, "stopping": {"maxNewTokens": 4}}
    msgs = await generate(stub, {"sessionId": sid, **eos})
    assert msgs[0].session_continued and sequences(msgs)[0]["finish"] == pb.FINISH_REASON_EOS
    with pytest.raises(grpc.aio.AioRpcError) as e:  # EOS ended the conversation: nothing to continue
        await generate(stub, {"sessionId": sid, **GREEDY})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


INVALID = [
    ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ({"text": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND, "model"),
    ({"tokenIds": {"ids": [99999]}}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ({"text": "x", "sampling": {"temperature": -1}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ({"text": "x", "sampling": {"topP": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ({"text": "x", "sampling": {"topK": -1}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    (
        {"text": "x", "sampling": {"repetitionPenalty": 0}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.repetition_penalty",
    ),
    ({"text": "x", "sampling": {"presencePenalty": 3}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty"),
    (
        {"text": "x", "sampling": {"frequencyPenalty": -3}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.frequency_penalty",
    ),
    ({"text": "x", "sampling": {"n": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.n"),
    ({"text": "x", "sampling": {"numBeams": 2}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.num_beams"),
    (
        {"text": "x", "output": {"logprobs": True, "topLogprobs": 21}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "output.top_logprobs",
    ),
    ({"text": "x", "output": {"topLogprobs": 2}}, grpc.StatusCode.INVALID_ARGUMENT, "output.top_logprobs"),
    ({"text": "x", "stopping": {"maxNewTokens": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens"),
    ({"text": "x", "stopping": {"maxNewTokens": 1024}}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens"),
    ({"text": "x " * 1100}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ({"text": "x", "stopping": {"stop": ["a"] * 17}}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.stop"),
    ({"text": "x", "stopping": {"minNewTokens": 31}}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.min_new_tokens"),
    (
        {"messages": {"messages": [{"role": "user", "content": [{"imageUrl": {"url": "http://x/y.png"}}]}]}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].content",
    ),
]


@pytest.mark.parametrize("body_, code, field", INVALID, ids=[f"{i}-{x[2]}" for i, x in enumerate(INVALID)])
async def test_validation_errors_carry_code_and_field(stub, body_, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, body_)
    assert e.value.code() == code
    assert bad_request_field(e.value) == field
    assert e.value.details()


async def test_get_model_info_and_tokenize(stub, tokenizer):
    info = await stub.GetModelInfo(spb.GetModelInfoRequest())
    assert (info.model_name, info.model_version, info.engine) == ("tiny", "1", "hf")
    assert info.max_context_length == 1024 and info.vocab_size == tokenizer.vocab_size
    assert info.max_input_tokens == 1023  # one token of the context is left for generation
    assert info.has_chat_template and not info.accepts_images and info.max_num_beams == 1
    assert info.default_max_new_tokens == 30 and info.max_top_logprobs == 20
    assert info.greedy_defaults.do_sample is False and info.sampling_defaults.do_sample is True
    assert not info.greedy_defaults.HasField("seed")
    tok = await stub.Tokenize(spb.TokenizeRequest(text="Hello world"))
    assert list(tok.token_ids) == tokenizer.encode("Hello world")
    assert [(s.start, s.stop) for s in tok.spans] == tokenizer.spans("Hello world", list(tok.token_ids))
    assert b"".join(b"Hello world"[s.start : s.stop] for s in tok.spans) == b"Hello world"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Tokenize(spb.TokenizeRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    image = pb.ChatMessage(role="user", content=[pb.ContentPart(image_url=pb.ImageUrl(url="http://x/y.png"))])
    with pytest.raises(grpc.aio.AioRpcError) as e:  # refused as Generate refuses it, not dropped
        await stub.Tokenize(spb.TokenizeRequest(messages=pb.ChatMessages(messages=[image])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_request_field(e.value) == "messages[0].content"


async def test_cancelled_streams_leave_nothing_behind(core, stub):
    long = {"text": "cancel me", "stopping": {"maxNewTokens": 400, "ignoreEos": True}}
    sessions = [f"cancelled-{i}-{random.random()}" for i in range(10)]

    async def cancel_after(i: int, reads: int):
        call = stub.Generate(request({**long, "sessionId": sessions[i]} if i < len(sessions) else long))
        for _ in range(reads):
            await call.read()
        call.cancel()

    rng = random.Random(0)
    await asyncio.gather(*(cancel_after(i, rng.choice([0, 1, 2, 4, 6])) for i in range(100)))
    await wait_idle(core.engine)
    # the engine still serves afterwards, and no session is left busy
    assert (await generate(stub, body()))[-1].usage.completion_tokens == 12
    for sid in sessions:
        assert (await generate(stub, body(stopping={"maxNewTokens": 1}, sessionId=sid)))[-1].HasField("usage")


async def test_queue_full_is_resource_exhausted_before_any_message(tiny_model_dir):
    server = await start_core(
        core_config(tiny_model_dir, max_batch_size=1, max_queue_size=1, max_total_tokens=800, engine_process=False)
    )
    try:
        channel = grpc.aio.insecure_channel(server.address)
        stub = spb_grpc.GenerateServiceStub(channel)
        # long enough to outlast every check below, which it is cancelled after
        long = request({"text": "x", "stopping": {"maxNewTokens": 790, "ignoreEos": True}})
        running = stub.Generate(long)
        while (await running.read()).state != pb.GENERATE_STATE_GENERATING:
            pass
        waiting = stub.Generate(long)
        assert (await waiting.read()).state == pb.GENERATE_STATE_QUEUED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, body())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as e:  # more than --max-total-tokens can ever hold
            await generate(stub, body(stopping={"maxNewTokens": 900}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_field(e.value) == "stopping.max_new_tokens"
        waiting.cancel()
        await wait_for(lambda: server.engine.stats().queued == 0)
        # a time limit also ends a request that never left the queue
        msgs = await generate(stub, body(stopping={"timeLimitMs": 200}))
        assert msgs[-1].HasField("usage") and msgs[-1].usage.completion_tokens == 0
        assert sequences(msgs)[0]["finish"] == pb.FINISH_REASON_TIME_LIMIT
        running.cancel()
        await wait_idle(server.engine)
        await channel.close()
    finally:
        await server.stop(0)


def _grpcurl(*args: str) -> str:
    return subprocess.run(
        ["grpcurl", "-plaintext", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl is installed by the dev extra")
async def test_health_reflection_and_generate_with_grpcurl(core):
    addr = core.address
    listing = await asyncio.to_thread(_grpcurl, addr, "list")
    assert {"trellis.generate.v1.GenerateService", "grpc.health.v1.Health"} <= set(listing.split())
    described = await asyncio.to_thread(_grpcurl, addr, "describe", "trellis.generate.v1.GenerateService")
    assert "rpc Generate ( .trellis.generate.v1.GenerateRequest ) returns ( stream" in described
    health = await asyncio.to_thread(_grpcurl, addr, "grpc.health.v1.Health/Check")
    assert json.loads(health)["status"] == "SERVING"
    out = await asyncio.to_thread(
        _grpcurl,
        "-d",
        '{"text": "hello", "stopping": {"max_new_tokens": 4}}',
        addr,
        "trellis.generate.v1.GenerateService/Generate",
    )
    messages = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[0]["state"] == "GENERATE_STATE_QUEUED"
    assert messages[-1]["usage"]["completion_tokens"] == 4


async def test_health_service_reports_serving(core):
    async with grpc.aio.insecure_channel(core.address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
