"""The defects a hostile run found, each
reproduced against real servers on loopback: the mock-engine core in-process, real gateways,
real clients. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from core.multiplex import MAX_STARTS_PER_MESSAGE
from core.pipeline import OFF_LOOP_CHARS, OFF_LOOP_MESSAGES
from core.tokenizer import Tokenizer
from core.validation import MAX_MESSAGES, tail_for_truncation
from gateways.common.status import GatewayError
from logclip import MAX_ARG_CHARS, ClipFilter
from tests.integration.gateway_helpers import CANCELLED, CLOSED

pytestmark = pytest.mark.timeout(120)

SURROGATE_JSON = '"a\\ud800b"'  # JSON text of a string with a lone surrogate escape
CHAT = '{"model":"mock","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture(scope="module")
async def gateways(mock_core, start_gateway):
    """One gateway of each kind on the shared mock core."""
    return {name: await start_gateway(name, core=mock_core.address) for name in ("openai", "lmi", "triton", "ws")}


def _request(text: str, **stopping) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        text=text,
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=4, **stopping),
    )


async def _generate(stub, request) -> list[spb.GenerateResponse]:
    return [m async for m in stub.Generate(request)]


# ---------------------------------------------------------------- item 2: huge prompts


async def test_a_prompt_too_long_for_any_context_is_refused_by_its_length(mock_core):
    """1.5 MB of text cannot fit the context: refused before tokenization (the message counts
    characters, not tokens), CONTEXT_LENGTH_EXCEEDED naming the field."""
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(stub, _request("word " * 300_000))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "1500000 characters" in e.value.details()
    err = GatewayError.from_rpc_error(e.value)
    assert (err.reason, err.param) == ("CONTEXT_LENGTH_EXCEEDED", "text")


async def test_a_long_prompt_with_truncation_is_served_from_its_tail(mock_core):
    """truncate_input_tokens keeps a long prompt servable: only its tail is tokenized."""
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        msgs = await _generate(stub, _request("word " * 300_000, truncate_input_tokens=8))
    assert msgs[-1].usage.prompt_tokens == 8


def test_the_tail_tokenizes_like_the_whole_prompt_where_truncation_keeps_it(tiny_model_dir):
    tok = Tokenizer.load(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 400
    whole = tok.encode(text)
    tail = tok.encode(tail_for_truncation(text, 50, tok.max_token_chars))
    assert len(tail) < len(whole)
    assert tail[-50:] == whole[-50:]


async def test_long_prompts_are_tokenized_off_the_event_loop(mock_core, monkeypatch):
    """A long prompt's tokenization runs on the tokenizer thread, never on the serving loop,
    on Generate and on MultiplexGenerate (the gateways' path)."""
    import threading

    pipeline = mock_core.servicer.pipeline
    threads: list[str] = []
    encode = pipeline.tokenizer.encode

    def spy(text, add_special_tokens=True, **options):
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens, **options)

    monkeypatch.setattr(pipeline.tokenizer, "encode", spy)
    text = "word " * (OFF_LOOP_CHARS // 4)
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):  # longer than the tiny model's context
            await _generate(stub, _request(text))
        call = stub.MultiplexGenerate()
        await call.write(spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=1, request=_request(text))]))
        msg = await call.read()
        call.cancel()
    assert msg.events[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert len(threads) == 2
    assert all(name.startswith("tokenizer") for name in threads), threads


async def test_a_chat_of_many_short_messages_is_rendered_off_the_event_loop(mock_core, monkeypatch):
    """Many empty messages count no characters but cost the template a render each: a chat of
    more than OFF_LOOP_MESSAGES messages is prepared on the tokenizer thread too."""
    import threading

    pipeline = mock_core.servicer.pipeline
    threads: list[str] = []
    render = pipeline.tokenizer.render_chat

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return render(*args, **kwargs)

    monkeypatch.setattr(pipeline.tokenizer, "render_chat", spy)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user") for _ in range(OFF_LOOP_MESSAGES + 1)])
    request = spb.GenerateRequest(messages=chat, stopping=pb.StoppingParams(max_new_tokens=2))
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        call = spb_grpc.GenerateServiceStub(channel).MultiplexGenerate()
        await call.write(spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=1, request=request)]))
        async for msg in call:
            if any(ev.HasField("status") for ev in msg.events):
                break
        call.cancel()
    assert threads and all(name.startswith("tokenizer") for name in threads), threads


async def test_a_chat_of_too_many_messages_is_refused_before_rendering(mock_core):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user") for _ in range(MAX_MESSAGES + 1)])
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(stub, spb.GenerateRequest(messages=chat))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"At most {MAX_MESSAGES} messages" in e.value.details()
    assert GatewayError.from_rpc_error(e.value).param == "messages"


@pytest.mark.parametrize("starts", [MAX_STARTS_PER_MESSAGE, MAX_STARTS_PER_MESSAGE + 1])
async def test_a_multiplex_message_with_too_many_starts_ends_the_stream(mock_core, starts):
    """Each start is validated and admitted on the core's loop: one message may carry at most
    MAX_STARTS_PER_MESSAGE; more end the stream with RESOURCE_EXHAUSTED before any starts."""
    request = _request("hi")
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        call = spb_grpc.GenerateServiceStub(channel).MultiplexGenerate()
        msg = spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=i, request=request) for i in range(starts)])
        await call.write(msg)
        if starts > MAX_STARTS_PER_MESSAGE:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"at most {MAX_STARTS_PER_MESSAGE} requests" in e.value.details()
        else:
            first = await call.read()
            assert first.events or first.HasField("steps")
        call.cancel()


async def test_long_stop_strings_are_refused(mock_core):
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        request = _request("Hello")
        request.stopping.stop.append("x" * 450_000)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(stub, request)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert GatewayError.from_rpc_error(e.value).param == "stopping.stop"


# ---------------------------------------------------------------- item 3: lone surrogates


@pytest.mark.parametrize(
    "gateway, path, body, status, field",
    [
        ("openai", "/v1/chat/completions", '{"model":"mock","messages":[{"role":"user","content":%s}]}', 400, None),
        ("openai", "/v1/chat/completions", CHAT[:-1] + ',"stop":[%s]}', 400, "stop[0]"),
        ("openai", "/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"model":%s}', 400, "model"),
        ("lmi", "/invocations", '{"inputs":%s}', 424, None),
        ("lmi", "/invocations", '{"inputs":"hi","parameters":{"stop_sequences":[%s]}}', 424, None),
        ("triton", "/v2/models/mock/generate", '{"text_input":%s}', 400, None),
        ("triton", "/v2/models/mock/generate_stream", '{"text_input":"hi","stop_words":[%s]}', 400, None),
        ("triton", "/v2/models/mock/generate", '{"text_input":"hi","id":%s}', 400, None),
    ],
)
async def test_a_lone_surrogate_is_a_client_error_naming_the_field(gateways, gateway, path, body, status, field):
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            gateways[gateway] + path, data=body % SURROGATE_JSON, headers={"Content-Type": "application/json"}
        )
        text = await resp.text()
    assert resp.status == status, text
    assert "lone surrogate" in text
    if field is not None:
        assert json.loads(text)["error"]["param"] == field


async def test_a_lone_surrogate_on_websocket_refuses_that_frame_only(gateways):
    """The other prompt streaming on the socket completes; the socket stays open."""
    url = gateways["ws"].replace("http", "ws") + "/ws"
    async with connect(url) as ws:
        good = {"prompts": [{"request_id": "good", "prompt": "Hello"}], "generation_config": {"max_new_tokens": 20}}
        await ws.send(json.dumps(good))
        await ws.send('{"prompts":[{"request_id":"bad","prompt":' + SURROGATE_JSON + "}]}")
        refused, completed = None, False
        while not completed:
            for event in json.loads(await asyncio.wait_for(ws.recv(), 30)):
                if "request_id" not in event:
                    refused = event
                completed |= event.get("type") == "COMPLETE"
    assert refused is not None and "prompts[0].prompt" in refused["error"]
    assert "lone surrogate" in refused["error"]


# ---------------------------------------------------------------- item 4: grpc wording


@pytest.mark.parametrize(
    "code, grpc_text, sentence, reason",
    [
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", CLOSED, "CORE_UNAVAILABLE"),
        (grpc.StatusCode.UNKNOWN, "Stream removed", CLOSED, "CORE_UNAVAILABLE"),
        (grpc.StatusCode.CANCELLED, "Cancelling all calls", CANCELLED, "CANCELLED"),
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses",
            "The model server cannot be reached.",
            "CORE_UNREACHABLE",
        ),
    ],
)
def test_grpc_wording_becomes_a_documented_sentence_with_a_code(code, grpc_text, sentence, reason):
    err = GatewayError.from_status(code.value[0], grpc_text, ())
    assert (err.message, err.reason) == (sentence, reason)


def test_the_cores_own_errors_keep_their_words():
    err = GatewayError.from_status(grpc.StatusCode.INTERNAL.value[0], "The engine failed this request.", ())
    assert (err.message, err.reason) == ("The engine failed this request.", "INTERNAL")


async def test_a_core_stopped_mid_stream_reaches_openai_clients_in_documented_words(start_mock_core, start_gateway):
    core = await start_mock_core(mock_step_ms=20)
    url = await start_gateway("openai", core=core.address)
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 500}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/v1/chat/completions", json=body)
        await resp.content.readline()
        await core.stop(0)
        text = (await resp.read()).decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    if errors:  # the stream broke under the request
        assert errors[0]["message"] in (CLOSED, CANCELLED)
        assert errors[0]["code"] is not None
    else:  # the core ended the request itself while stopping: OpenAI's word for it (vLLM's)
        finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
        assert finishes == ["abort"], text[-500:]
    assert text.rstrip().endswith("data: [DONE]")


# ---------------------------------------------------------------- item 5: drain (tests/reliability/test_drain.py)


# ---------------------------------------------------------------- item 6: malformed protobuf


@pytest.mark.parametrize("raw", [b"\x0a\x03\xff\xfe\xfd", b"\xff\xff\xff\xff"], ids=["invalid-utf8", "corrupt"])
async def test_a_malformed_request_is_invalid_argument_with_one_log_line(mock_core, raw, caplog):
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        generate = channel.unary_stream("/trellis.generate.v1.GenerateService/Generate")
        with caplog.at_level(logging.INFO), pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in generate(raw):
                pass
        tokenize = channel.unary_unary("/trellis.generate.v1.GenerateService/Tokenize")
        with pytest.raises(grpc.aio.AioRpcError) as t:
            await tokenize(raw)
        multiplex = channel.stream_stream("/trellis.generate.v1.GenerateService/MultiplexGenerate")
        call = multiplex()
        await call.write(raw)
        with pytest.raises(grpc.aio.AioRpcError) as m:
            await call.read()
    for err in (e.value, t.value, m.value):
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in err.details()
    assert not [r for r in caplog.records if r.name.startswith("core") and (r.levelno >= logging.ERROR or r.exc_info)]


# ---------------------------------------------------------------- item 7: content types


@pytest.mark.parametrize("ctype", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "text/xml"])
@pytest.mark.parametrize(
    "gateway, path, body",
    [
        (
            "openai",
            "/v1/chat/completions",
            {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
        ("lmi", "/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ],
)
async def test_a_body_declared_as_not_json_is_415(gateways, gateway, path, body, ctype):
    async with aiohttp.ClientSession() as http:
        resp = await http.post(gateways[gateway] + path, data=json.dumps(body), headers={"Content-Type": ctype})
        text = await resp.text()
        assert resp.status == 415, text
        assert "application/json" in text
        ok = await http.post(
            gateways[gateway] + path, data=json.dumps(body), headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert ok.status == 200
        await ok.read()
        bare = await http.post(
            gateways[gateway] + path, data=json.dumps(body).encode(), skip_auto_headers=["Content-Type"]
        )
        assert bare.status == 200, await bare.text()
        await bare.read()


# ---------------------------------------------------------------- item 8: health, logs


async def test_the_websocket_gateway_has_a_health_route(gateways):
    async with aiohttp.ClientSession() as http:
        resp = await http.get(gateways["ws"] + "/health")
        assert (resp.status, await resp.json()) == (200, {"status": "serving"})


def test_client_strings_in_log_lines_are_clipped():
    record = logging.LogRecord("core", logging.INFO, __file__, 1, "request %s: %s", ("r" * 100_000, "short"), None)
    ClipFilter().filter(record)
    line = record.getMessage()
    assert len(line) < MAX_ARG_CHARS + 100
    assert line.endswith("[100000 characters]: short")


# ---------------------------------------------------------------- found by make soak's gRPC fuzz


@pytest.mark.parametrize(
    "request_, code",
    [
        (spb.GenerateRequest(text="hi", model="x" * 100_000), grpc.StatusCode.NOT_FOUND),
        (spb.GenerateRequest(session_id="s" * 100_000), grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["model", "session_id"],
)
async def test_a_huge_client_string_quoted_in_an_error_keeps_the_errors_status(mock_core, request_, code):
    """A 100,000-character model name or session id used to be quoted whole in the error: the
    status's message and its BadRequest detail passed gRPC's 16 KiB metadata limit, so the client
    got RESOURCE_EXHAUSTED "Stream removed" (an overload code: gateways answer it with 429 and a
    Retry-After) instead of the error. Quoted client strings are clipped now."""
    async with grpc.aio.insecure_channel(mock_core.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(spb_grpc.GenerateServiceStub(channel), request_)
    assert e.value.code() is code
    assert "[100000 characters]" in e.value.details()


async def test_a_huge_model_name_through_a_gateway_is_not_found(gateways):
    body = {"model": "x" * 100_000, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(gateways["openai"] + "/v1/chat/completions", json=body)
        answer = await resp.json()
    assert resp.status == 404, answer
    assert len(answer["error"]["message"]) < 1000
