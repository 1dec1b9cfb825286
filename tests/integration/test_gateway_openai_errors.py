"""Errors of the OpenAI gateway, end to end on loopback: every validation error raises the
`openai` SDK's typed exception with `param` set (whether the gateway or the core found it), the
first-message rule for streams, raw-HTTP failures (bad JSON, routing, body size), an
unreachable core, a full queue, a deadline, and failures after the stream started (in-band
`{"error": ...}` then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from core.server import start_core
from tests.conftest import core_config

MODEL = "tiny"
HI = [{"role": "user", "content": "Hello there."}]
BAN = {str(i): -100 for i in range(8)}


def sdk(url: str, cls=openai.AsyncOpenAI):
    return cls(base_url=f"{url}/v1", api_key="unused", max_retries=0)


IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]
LONG = [{"role": "user", "content": "garden " * 1500}]

VALIDATION = [
    # (id, create() arguments, exception, param, code); "core" in a comment marks a value the
    # core checks (google.rpc BadRequest field path mapped back to the OpenAI name).
    ("temperature_above_2", {"temperature": 2.5}, openai.BadRequestError, "temperature", "invalid_argument"),
    ("temperature_type", {"temperature": "hot"}, openai.BadRequestError, "temperature", "invalid_argument"),
    ("top_p_zero", {"top_p": 0}, openai.BadRequestError, "top_p", "invalid_argument"),  # core
    (
        "presence_penalty",
        {"presence_penalty": 3},
        openai.BadRequestError,
        "presence_penalty",
        "invalid_argument",
    ),  # core
    (
        "frequency_penalty",
        {"frequency_penalty": -2.5},
        openai.BadRequestError,
        "frequency_penalty",
        "invalid_argument",
    ),  # core
    ("logit_bias_key", {"logit_bias": {"abc": 1}}, openai.BadRequestError, "logit_bias", "invalid_argument"),
    ("logit_bias_value", {"logit_bias": {"5": 101}}, openai.BadRequestError, "logit_bias", "invalid_argument"),  # core
    (
        "logit_bias_vocab",
        {"logit_bias": {"99999": 1}},
        openai.BadRequestError,
        "logit_bias",
        "invalid_argument",
    ),  # core
    (
        "top_logprobs_range",
        {"logprobs": True, "top_logprobs": 21},
        openai.BadRequestError,
        "top_logprobs",
        "invalid_argument",
    ),  # core
    (
        "top_logprobs_needs_logprobs",
        {"top_logprobs": 2},
        openai.BadRequestError,
        "top_logprobs",
        "invalid_argument",
    ),  # core
    ("max_tokens_zero", {"max_tokens": 0}, openai.BadRequestError, "max_tokens", "invalid_argument"),  # core
    (
        "max_completion_tokens_zero",
        {"max_completion_tokens": 0},
        openai.BadRequestError,
        "max_completion_tokens",
        "invalid_argument",
    ),  # core
    (
        "max_tokens_beyond_context",
        {"max_tokens": 5000},
        openai.BadRequestError,
        "max_tokens",
        "invalid_argument",
    ),  # core
    ("n_zero", {"n": 0}, openai.BadRequestError, "n", "invalid_argument"),  # core
    ("n_above_limit", {"n": 17}, openai.BadRequestError, "n", "invalid_argument"),  # core
    # core: its --max-stop-sequences (16), not OpenAI's 4
    (
        "stop_beyond_core_bound",
        {"stop": [f"s{i}" for i in range(17)]},
        openai.BadRequestError,
        "stop",
        "invalid_argument",
    ),
    ("stop_empty", {"stop": [""]}, openai.BadRequestError, "stop", "invalid_argument"),  # core
    ("seed_type", {"seed": "x"}, openai.BadRequestError, "seed", "invalid_argument"),
    (
        "ignore_eos_type",
        {"extra_body": {"ignore_eos": "yes"}},
        openai.BadRequestError,
        "ignore_eos",
        "invalid_argument",
    ),
    ("unknown_parameter", {"extra_body": {"best_of": 2}}, openai.BadRequestError, "best_of", "unknown_parameter"),
    (
        "tool_schema_does_not_compile",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
            "tool_choice": "required",
        },
        openai.BadRequestError,
        "tools",
        "invalid_argument",
    ),  # core
    (
        "response_format_schema_does_not_compile",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        openai.BadRequestError,
        "response_format",
        "invalid_argument",
    ),  # core
    (
        "legacy_functions",
        {"extra_body": {"functions": [{"name": "f"}]}},
        openai.BadRequestError,
        "functions",
        "unsupported_parameter",
    ),
    (
        "stream_options_without_stream",
        {"stream_options": {"include_usage": True}},
        openai.BadRequestError,
        "stream_options",
        "invalid_argument",
    ),
    (
        "image_part_on_a_text_model",
        {"messages": IMAGE},
        openai.BadRequestError,
        "messages[0].content",
        "invalid_argument",
    ),  # core
    (
        "function_role",
        {"messages": [{"role": "function", "content": "x", "name": "f"}]},
        openai.BadRequestError,
        "messages[0].role",
        "invalid_argument",
    ),
    (
        "tool_message_without_call_id",
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]},
        openai.BadRequestError,
        "messages[1].tool_call_id",
        "invalid_argument",
    ),  # core
    ("empty_messages", {"messages": []}, openai.BadRequestError, "messages", "invalid_argument"),  # core
    ("prompt_too_long", {"messages": LONG}, openai.BadRequestError, "messages", "context_length_exceeded"),  # core
    ("unknown_model", {"model": "gpt-4o"}, openai.NotFoundError, "model", "model_not_found"),  # core
]


@pytest.mark.parametrize("flavor", ["async", "sync"])
@pytest.mark.parametrize("kwargs, exc, param, code", [c[1:] for c in VALIDATION], ids=[c[0] for c in VALIDATION])
async def test_validation_errors_are_typed_with_param(base_url, flavor, kwargs, exc, param, code):
    args = {"model": MODEL, "messages": HI, "max_tokens": 2, **kwargs}
    if flavor == "async":
        async with sdk(base_url) as client:
            with pytest.raises(exc) as info:
                await client.chat.completions.create(**args)
    else:
        with sdk(base_url, openai.OpenAI) as client, pytest.raises(exc) as info:
            await asyncio.to_thread(client.chat.completions.create, **args)
    err = info.value
    assert err.param == param
    assert err.code == code
    assert err.type == "invalid_request_error"
    assert err.body["message"] and err.message
    assert err.response.headers["x-request-id"].startswith("chatcmpl-")


@pytest.mark.parametrize(
    "kwargs, param",
    [({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"model": "gpt-4o"}, "model")],
    ids=["gateway", "core", "model"],
)
async def test_streaming_errors_before_the_first_byte_have_a_status(base_url, kwargs, param):
    async with sdk(base_url) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(**{"model": MODEL, "messages": HI, "stream": True, **kwargs})
    assert info.value.status_code in (400, 404) and info.value.param == param


# --------------------------------------------------------------------------- raw HTTP


async def post_raw(url: str, data: bytes, path="/v1/chat/completions"):
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, r.content_type, await r.json()


RAW = [
    ("malformed_json", b'{"messages": [', 400),
    ("nan_is_not_json", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    ("not_utf8", b'{"messages": [{"role": "user", "content": "\xff"}]}', 400),
    ("array_body", b'[{"role": "user", "content": "x"}]', 400),
    ("empty_body", b"", 400),
]


@pytest.mark.parametrize("data, status", [c[1:] for c in RAW], ids=[c[0] for c in RAW])
async def test_unreadable_bodies(base_url, data, status):
    got_status, content_type, body = await post_raw(base_url, data)
    assert (got_status, content_type) == (status, "application/json")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_unknown_path_and_method(base_url):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base_url}/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.get(f"{base_url}/v1/chat/completions") as r:
            assert r.status == 405
            assert "GET /v1/chat/completions" in (await r.json())["error"]["message"]


async def test_body_too_large(start_gateway):
    url = await start_gateway("openai", max_body_bytes=1024)
    data = json.dumps({"messages": [{"role": "user", "content": "x" * 4096}]}).encode()
    status, _, body = await post_raw(url, data)
    assert status == 413
    assert body["error"]["type"] == "invalid_request_error" and "1024" in body["error"]["message"]


# --------------------------------------------------------------------------- core-side failures


async def test_unreachable_core(start_gateway):
    url = await start_gateway("openai", core="127.0.0.1:1")
    async with sdk(url) as client:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(model=MODEL, messages=HI, stream=stream)
            assert info.value.status_code == 503 and info.value.type == "server_error"
        with pytest.raises(openai.InternalServerError):
            await client.models.list()
        with pytest.raises(openai.InternalServerError):
            await client.models.retrieve(MODEL)
    async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
        assert r.status == 503


async def test_deadline(start_gateway):
    # Non-streaming, so the deadline always hits before the response starts (a stream may get
    # its first message in before the deadline fires and then reports it in-band).
    url = await start_gateway("openai", request_timeout=1e-6)
    async with sdk(url) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50)
    assert info.value.status_code == 504 and info.value.type == "server_error"


async def test_full_queue_is_429_and_503_for_lmi(start_gateway, tiny_model_dir):
    busy = await start_core(core_config(tiny_model_dir, max_queue_size=0, engine_process=False))
    try:
        url = await start_gateway("openai", core=busy.address)
        async with sdk(url) as client:
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as info:
                    await client.chat.completions.create(model=MODEL, messages=HI, stream=stream)
                assert info.value.type == "rate_limit_error" and info.value.code == "queue_full"
        lmi = await start_gateway("lmi", core=busy.address)
        async with aiohttp.ClientSession() as s, s.post(f"{lmi}/invocations", json={"messages": HI}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "queue_full"
    finally:
        await busy.stop(0)


async def read_event(resp) -> bytes:
    return await resp.content.readuntil(b"\n\n")


async def test_failure_after_the_stream_started_is_in_band(start_gateway, tiny_model_dir):
    """The core goes away mid-stream: status 200 is already sent, so each framing ends with its
    in-band error (SSE: `data: {"error": ...}` then `data: [DONE]`; jsonlines: an error line;
    the SDK raises APIError while iterating)."""
    doomed = await start_core(core_config(tiny_model_dir, engine_process=False))
    body = {"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True, "logit_bias": BAN, "stream": True}
    try:
        url = await start_gateway("openai", core=doomed.address)
        lmi = await start_gateway("lmi", core=doomed.address)
        async with aiohttp.ClientSession() as s, sdk(url) as client:
            sse = await s.post(f"{url}/v1/chat/completions", json=body)
            jsonl = await s.post(f"{lmi}/invocations", json=body)
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=HI,
                max_tokens=1000,
                logit_bias=BAN,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert sse.status == 200 and jsonl.status == 200
            await read_event(sse)
            await jsonl.content.readline()
            await stream.__anext__()
            await doomed.stop(0)

            events = (await sse.read()).decode().split("\n\n")
            assert events[-1] == "" and events[-2] == "data: [DONE]"
            error = json.loads(events[-3].removeprefix("data: "))["error"]
            assert error["type"] == "server_error" and error["message"]
            assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-3] if e)

            lines = (await jsonl.read()).decode().splitlines()
            assert json.loads(lines[-1])["error"]["type"] == "server_error"
            assert "[DONE]" not in lines[-1]

            with pytest.raises(openai.APIError) as info:
                async for _ in stream:
                    pass
            assert info.value.type == "server_error"
    finally:
        await doomed.stop(0)
