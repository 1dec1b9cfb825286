"""The OpenAI gateway with the official `openai` SDK (sync and async) against a real gateway and
the shared in-process core on loopback: non-streaming, streaming, n, stop strings, seeds,
logprobs, include_usage, EOS handling, the seed's examples by shape, LMI framing through
`handle_chat`, and client disconnects cancelling the core's request.

The tiny test model is untrained, so tests compare outputs with each other (greedy runs are
deterministic) rather than with fixed text. BAN suppresses the special tokens (ids 0-7: pad,
BOS, EOS, chat markers) so outputs run to max_tokens and their text equals their token bytes.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import pytest_asyncio

from tests.golden.harness import GOLDEN, load, match, shape_of
from tests.integration.core_helpers import wait_idle

MODEL = "tiny"
BAN = {str(i): -100 for i in range(8)}
HI = [{"role": "user", "content": "Tell me about gardens."}]


@pytest_asyncio.fixture(scope="module")
async def lmi_url(start_gateway) -> str:
    """The LMI gateway, which answers chat bodies on POST /invocations with this gateway's
    handle_chat (jsonlines framing, LMI finish reasons)."""
    return await start_gateway("lmi")


@pytest.fixture
def client(base_url):
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


def in_thread(fn, *args, **kwargs):
    """Run a blocking SDK call off the event loop (the gateway and core share the loop)."""
    return asyncio.to_thread(fn, *args, **kwargs)


async def collect_stream(stream) -> list:
    return [chunk async for chunk in stream]


def joined(chunks, index=0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


# --------------------------------------------------------------------------- models, health


async def test_models_list_and_retrieve(aclient, client):
    models = await aclient.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "trellis" and isinstance(card.created, int)
    got = await in_thread(client.models.retrieve, MODEL)
    assert got.id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        await aclient.models.retrieve("gpt-4o")
    assert info.value.param == "model" and info.value.code == "model_not_found"


async def test_health(base_url):
    async with aiohttp.ClientSession() as s, s.get(f"{base_url}/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "serving"}


# --------------------------------------------------------------------------- non-streaming


def check_completion(resp, n=1):
    assert resp.id.startswith("chatcmpl-") and len(resp.id) > len("chatcmpl-")
    assert resp.object == "chat.completion"
    assert isinstance(resp.created, int) and resp.created > 0
    assert resp.model == MODEL
    assert [c.index for c in resp.choices] == list(range(n))
    for c in resp.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


async def test_non_streaming_sync(client):
    resp = await in_thread(client.chat.completions.create, model=MODEL, messages=HI, max_tokens=6, logit_bias=BAN)
    check_completion(resp)
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].logprobs is None
    assert resp.usage.completion_tokens == 6


async def test_non_streaming_async_without_model(aclient):
    # The seed makes `model` optional; the SDK always sends one, so go through extra_body-free raw
    # options: an omitted model is the served one.
    raw = await aclient.post(
        "/chat/completions", body={"messages": HI, "max_tokens": 3}, cast_to=openai.types.chat.ChatCompletion
    )
    check_completion(raw)


async def test_request_id_header_is_the_completion_id(aclient):
    raw = await aclient.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id


async def test_max_completion_tokens(aclient):
    resp = await aclient.chat.completions.create(
        model=MODEL, messages=HI, max_completion_tokens=3, max_tokens=9, logit_bias=BAN
    )
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


async def test_eos_is_stop_and_ignore_eos_runs_on(aclient):
    eos = {"2": 100}
    resp = await aclient.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, logit_bias=eos)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == ""  # the EOS token is not text
    resp = await aclient.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, logit_bias=eos, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5


async def test_messages_with_parts_roles_and_names(aclient):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "More?"},
    ]
    check_completion(await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=2))


# --------------------------------------------------------------------------- streaming


async def test_streaming_async_matches_non_streaming(aclient):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0, logit_bias=BAN)
    whole = await aclient.chat.completions.create(**kwargs)
    chunks = await collect_stream(await aclient.chat.completions.create(stream=True, **kwargs))
    assert len(chunks) >= 2
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.created for c in chunks} == {chunks[0].created}
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].choices[0].delta.content  # the last content chunk carries finish_reason
    assert joined(chunks) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)


async def test_streaming_sync(client):
    def run():
        stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, logit_bias=BAN, stream=True)
        return list(stream)

    chunks = await in_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert joined(chunks)


async def test_streaming_wire_format(base_url):
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, "logit_bias": BAN, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.content_type == "text/event-stream"
        assert r.headers["Cache-Control"] == "no-cache"
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert 1 <= len(chunks) <= 4  # one event per token (a token that is only part of a character waits)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_streaming_flushes_as_tokens_arrive(base_url, core):
    """Chunks reach the client one by one while the core is still generating the rest."""
    await wait_idle(core.engine)
    body = {"model": MODEL, "messages": HI, "max_tokens": 1000, "ignore_eos": True, "logit_bias": BAN, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/chat/completions", json=body) as r:
        events = [await r.content.readuntil(b"\n\n") for _ in range(5)]
        assert core.engine.stats().active == 1
    chunks = [json.loads(e[len(b"data: ") :]) for e in events]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    await wait_idle(core.engine)  # leaving cancelled the rest


# --------------------------------------------------------------------------- n, stop, seed


async def test_n2_non_streaming(aclient):
    resp = await aclient.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=5, logit_bias=BAN, seed=3)
    check_completion(resp, n=2)
    assert resp.usage.completion_tokens == 10


async def test_n2_streaming(aclient):
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=HI, n=2, max_tokens=5, logit_bias=BAN, seed=3, stream=True
    )
    chunks = await collect_stream(stream)
    assert all(len(c.choices) == 1 for c in chunks)
    whole = await aclient.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=5, logit_bias=BAN, seed=3)
    for i in (0, 1):
        mine = [c for c in chunks if c.choices[0].index == i]
        assert mine[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in mine][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in mine[:-1])
        assert joined(chunks, i) == whole.choices[i].message.content


async def test_stop_strings_are_not_in_the_output(aclient):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=24, temperature=0, logit_bias=BAN)
    full = (await aclient.chat.completions.create(**kwargs)).choices[0].message.content
    middle = len(full) // 2
    stop = full[middle : middle + 3]
    expected = full[: full.index(stop)]
    resp = await aclient.chat.completions.create(stop=stop, **kwargs)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = await collect_stream(await aclient.chat.completions.create(stop=[stop, "\u2603"], stream=True, **kwargs))
    assert joined(chunks) == expected
    assert all(stop not in (c.choices[0].delta.content or "") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_seed_reproducibility(aclient, client):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=10, temperature=1.0, logit_bias=BAN)
    a = await aclient.chat.completions.create(seed=1234, **kwargs)
    b = await in_thread(client.chat.completions.create, seed=1234, **kwargs)
    c = await aclient.chat.completions.create(seed=4321, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    chunks = await collect_stream(await aclient.chat.completions.create(seed=1234, stream=True, **kwargs))
    assert joined(chunks) == a.choices[0].message.content


# --------------------------------------------------------------------------- logprobs, usage


def check_logprobs(entries, k):
    for e in entries:
        assert isinstance(e.token, str) and e.logprob <= 0
        assert all(isinstance(b, int) and 0 <= b < 256 for b in e.bytes)
        assert len(e.top_logprobs) == k
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert all(isinstance(t.token, str) and isinstance(t.bytes, list) for t in e.top_logprobs)


async def test_logprobs_with_top_logprobs(aclient):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=8, logit_bias=BAN, logprobs=True, top_logprobs=3, seed=9)
    resp = await aclient.chat.completions.create(**kwargs)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens == 8
    check_logprobs(entries, 3)
    # A last token that is only part of a character ends the text with U+FFFD, as decoding does.
    assert bytes(b for e in entries for b in e.bytes).decode(errors="replace") == resp.choices[0].message.content
    chunks = await collect_stream(await aclient.chat.completions.create(stream=True, **kwargs))
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


async def test_logprobs_without_alternatives(aclient):
    resp = await aclient.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True, logit_bias=BAN)
    check_logprobs(resp.choices[0].logprobs.content, 0)


async def test_include_usage(aclient):
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=4,
        n=2,
        logit_bias=BAN,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = await collect_stream(stream)
    *content, last = chunks
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    assert last.choices == [] and last.id == content[0].id
    assert last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8


async def test_cached_prompt_tokens_are_reported_in_usage(aclient, base_url):
    """The core's prefix cache (on by default): the same long chat again reuses every full block
    of its prompt but the one with its last token, in `usage.prompt_tokens_details` of the
    response and of the include_usage chunk."""
    long = [{"role": "user", "content": "Describe the gardens of a walled city, path by path. " * 6}]
    greedy = dict(model=MODEL, messages=long, max_tokens=3, logit_bias=BAN, temperature=0)
    first = await aclient.chat.completions.create(**greedy)
    prompt = first.usage.prompt_tokens
    reused = (prompt - 1) // 16 * 16
    assert prompt > 48
    again = await aclient.chat.completions.create(**greedy)
    assert again.usage.prompt_tokens_details.cached_tokens == reused
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = await aclient.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True})
    last = (await collect_stream(stream))[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == reused
    async with aiohttp.ClientSession() as s:  # the raw JSON: OpenAI's shape, present only when > 0
        body = {"model": MODEL, "messages": long, "max_tokens": 2}
        async with s.post(f"{base_url}/v1/chat/completions", json=body) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": reused}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with s.post(f"{base_url}/v1/chat/completions", json=body) as r:
            assert "prompt_tokens_details" not in (await r.json())["usage"]  # shorter than a block


# --------------------------------------------------------------------------- the seed's examples


async def test_seed_request_non_streaming_matches_the_seed_shape(base_url):
    body = load(GOLDEN / "openai" / "seed_request.json")["body"]
    want = load(GOLDEN / "openai" / "seed_logprobs.json")["expected"]
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/chat/completions", json=body) as r:
        assert r.status == 200 and r.content_type == "application/json"
        got = await r.json()
    # Cached prompt tokens are reported only when there are some (the prefix cache may hold
    # this prompt from another test), an optional key beside the seed's.
    details = got["usage"].pop("prompt_tokens_details", {"cached_tokens": 1})
    assert list(details) == ["cached_tokens"] and details["cached_tokens"] > 0
    match(shape_of(want), got)
    assert got["id"].startswith("chatcmpl-") and got["object"] == "chat.completion"
    assert got["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("golden", ["seed_stream_sse", "seed_stream_jsonlines"])
async def test_seed_stream_matches_the_seed_shape(base_url, lmi_url, golden):
    case = load(GOLDEN / "openai" / f"{golden}.json")
    body = {**case["body"], "max_tokens": 6, "logit_bias": BAN}
    url = f"{base_url}/v1/chat/completions" if case["framing"] == "sse" else f"{lmi_url}/invocations"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    if case["framing"] == "sse":
        assert r.content_type == "text/event-stream"
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events.pop() == "[DONE]"
    else:
        assert r.content_type == "application/jsonlines"
        events = raw.splitlines()
        assert "[DONE]" not in raw
    chunks = [json.loads(e) for e in events]
    first, last = case["expected"][0], case["expected"][-1]
    middle = json.loads(json.dumps(last))
    middle["choices"][0]["finish_reason"] = None
    match(shape_of(first), chunks[0])
    match(shape_of(last), chunks[-1])
    for chunk in chunks[1:-1]:
        match(shape_of(middle), chunk)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- LMI /invocations


async def test_lmi_framing_and_finish_reasons(lmi_url):
    async with aiohttp.ClientSession() as s:
        body = {"messages": HI, "max_tokens": 5, "logit_bias": {"2": 100}}
        async with s.post(f"{lmi_url}/invocations", json=body) as r:
            assert r.status == 200 and r.content_type == "application/json"
            resp = await r.json()
        assert resp["object"] == "chat.completion" and resp["choices"][0]["finish_reason"] == "eos_token"

        body = {"messages": HI, "max_tokens": 24, "temperature": 0, "logit_bias": BAN}
        async with s.post(f"{lmi_url}/invocations", json=body) as r:
            full = (await r.json())["choices"][0]["message"]["content"]
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        async with s.post(f"{lmi_url}/invocations", json={**body, "stop": stop, "stream": True}) as r:
            lines = [json.loads(x) for x in (await r.read()).decode().splitlines()]
        assert lines[-1]["choices"][0]["finish_reason"] == "stop_sequence"
        assert "".join(x["choices"][0]["delta"].get("content", "") for x in lines) == full[: full.index(stop)]

        async with s.post(f"{lmi_url}/invocations", json={"messages": HI, "temperature": 9}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "temperature"


# --------------------------------------------------------------------------- disconnects


async def test_disconnect_mid_stream_cancels_the_core_request(aclient, core):
    await wait_idle(core.engine)
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1000, logit_bias=BAN, stream=True, extra_body={"ignore_eos": True}
    )
    first = await stream.__anext__()
    assert first.choices[0].delta.role == "assistant"
    assert core.engine.stats().active == 1
    await stream.close()
    await wait_idle(core.engine)


async def test_disconnect_while_waiting_for_a_completion_cancels_it(aclient, core):
    await wait_idle(core.engine)
    task = asyncio.create_task(
        aclient.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1000, logit_bias=BAN, extra_body={"ignore_eos": True}
        )
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while core.engine.stats().active == 0:
        assert loop.time() < deadline and not task.done()
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(core.engine)
