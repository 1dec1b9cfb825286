"""TGI's own routes on the LMI gateway (gateways.lmi.tgi_routes) with TGI's real clients,
unmodified, against a real gateway and core on loopback: `text_generation.Client` /
`AsyncClient` and `huggingface_hub.InferenceClient` on the base URL (they post to `/`),
`/generate`, `/generate_stream`, `/info`, `/health`, the OpenAI-compatible routes, TGI's error
shape, and a TGI client on `/invocations` of a gateway without --tgi-compat."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import huggingface_hub
import jsonschema
import pytest
import pytest_asyncio
import text_generation
from huggingface_hub.errors import ValidationError as HubValidationError
from text_generation.errors import ValidationError

from tests.golden.test_lmi import parse_records

Q = "What is Deep Learning?"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest_asyncio.fixture(scope="module")
async def base(start_gateway) -> str:
    """An LMI gateway with its default options (no --tgi-compat) on the shared core."""
    return await start_gateway("lmi")


@pytest_asyncio.fixture(scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http, url: str, body, headers=None) -> tuple[int, str, str]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.text()


# ------------------------------------------------------------------------------ the clients


async def test_text_generation_client_on_the_base_url(base):
    client = text_generation.Client(base, timeout=60)
    out = await asyncio.to_thread(
        client.generate, Q, max_new_tokens=5, decoder_input_details=True, top_n_tokens=2, seed=1
    )
    assert out.details.finish_reason.value in {"length", "eos_token"}
    assert out.details.generated_tokens == len(out.details.tokens)
    assert out.details.prefill[0].logprob is None and len(out.details.prefill) > 1
    assert len(out.details.top_tokens) == len(out.details.tokens)
    assert all(len(top) == 2 for top in out.details.top_tokens)
    assert "".join(t.text for t in out.details.tokens) == out.generated_text
    assert out.details.seed is None  # greedy: TGI reports no seed

    def stream():
        return list(client.generate_stream(Q, max_new_tokens=5, top_n_tokens=2))

    chunks = await asyncio.to_thread(stream)
    assert chunks[-1].generated_text == out.generated_text
    assert chunks[-1].details.generated_tokens == len(chunks)
    assert all(c.details is None and c.generated_text is None for c in chunks[:-1])
    assert all(len(c.top_tokens) == 2 for c in chunks)
    assert "".join(c.token.text for c in chunks if not c.token.special) == out.generated_text


async def test_text_generation_async_client_sampling_best_of_and_stop(base):
    client = text_generation.AsyncClient(base, timeout=60)
    out = await client.generate(Q, max_new_tokens=4, do_sample=True, seed=3)
    assert out.details.seed == 3 and out.details.generated_tokens == len(out.details.tokens)
    texts = [r.token.text async for r in client.generate_stream(Q, max_new_tokens=4, do_sample=True, seed=3)]
    assert "".join(texts) == out.generated_text  # same seed, same text, streamed
    best = await client.generate(Q, max_new_tokens=3, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1
    stop = out.details.tokens[1].text
    if stop.strip() and stop not in out.details.tokens[0].text:
        stopped = await client.generate(Q, max_new_tokens=4, do_sample=True, seed=3, stop_sequences=[stop])
        assert stopped.details.finish_reason.value == "stop_sequence"


async def test_text_generation_client_grammar(base):
    client = text_generation.AsyncClient(base, timeout=60)
    grammar = text_generation.types.Grammar(type="json", value=SCHEMA)
    out = await client.generate("Say", max_new_tokens=30, grammar=grammar)
    jsonschema.validate(json.loads(out.generated_text), SCHEMA)
    regex = text_generation.types.Grammar(type="regex", value="[a-c]{3}-[0-9]{2}")
    texts = [r.token.text async for r in client.generate_stream("Say", max_new_tokens=30, grammar=regex)]
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", "".join(texts))


async def test_text_generation_client_errors(base):
    client = text_generation.AsyncClient(base, timeout=60)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        await client.generate(Q, max_new_tokens=0)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        async for _ in client.generate_stream(Q, max_new_tokens=0):
            pass
    with pytest.raises(ValidationError, match="watermark"):
        await client.generate(Q, watermark=True)


@pytest.fixture
def hub_online(monkeypatch):
    """huggingface_hub refuses every request in offline mode (HF_HUB_OFFLINE, which the test
    session sets); its clients here talk to the loopback gateway only."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


async def test_huggingface_hub_inference_client(base, hub_online):
    client = huggingface_hub.InferenceClient(base_url=base, timeout=60)
    text = await asyncio.to_thread(client.text_generation, Q, max_new_tokens=5)
    out = await asyncio.to_thread(client.text_generation, Q, max_new_tokens=5, details=True)
    assert out.generated_text == text and out.details.generated_tokens == 5
    assert out.details.finish_reason == "length"

    def stream(details: bool):
        return list(client.text_generation(Q, max_new_tokens=5, stream=True, details=details))

    assert "".join(await asyncio.to_thread(stream, False)) == text
    events = await asyncio.to_thread(stream, True)
    assert events[-1].generated_text == text and events[-1].details.generated_tokens == 5
    with pytest.raises(HubValidationError, match="top_p"):
        await asyncio.to_thread(client.text_generation, Q, top_p=1.5)


async def test_huggingface_hub_async_client_streams(base, hub_online):
    client = huggingface_hub.AsyncInferenceClient(base_url=base, timeout=60)
    text = await client.text_generation(Q, max_new_tokens=4)
    parts = [t async for t in await client.text_generation(Q, max_new_tokens=4, stream=True)]
    assert "".join(parts) == text
    with pytest.raises(HubValidationError, match="max_new_tokens"):
        async for _ in await client.text_generation(Q, max_new_tokens=0, stream=True):
            pass


# ------------------------------------------------------------------------------ the wire shapes


async def test_generate_shape(http, base):
    body = {"inputs": Q, "parameters": {"max_new_tokens": 3}}
    status, ctype, text = await post(http, base + "/generate", body)
    assert (status, ctype) == (200, "application/json")
    assert set(json.loads(text)) == {"generated_text"}  # details only when asked, as TGI
    status, _, text = await post(
        http, base + "/generate", {**body, "parameters": {"max_new_tokens": 3, "details": True}}
    )
    details = json.loads(text)["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["prefill"] == [] and set(details["tokens"][0]) == {"id", "text", "logprob", "special"}


async def test_generate_stream_shape(http, base):
    body = {"inputs": Q, "parameters": {"max_new_tokens": 3, "details": True}}
    status, ctype, text = await post(http, base + "/generate_stream", body)
    assert (status, ctype) == (200, "text/event-stream")
    events = parse_records(text, "sse")
    assert [e["index"] for e in events] == [1, 2, 3]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert set(last["details"]) == {"finish_reason", "generated_tokens", "seed", "input_length"}
    assert last["details"]["generated_tokens"] == 3 and last["details"]["input_length"] > 0
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)


@pytest.mark.parametrize(("stream", "ctype"), [(False, "application/json"), (True, "text/event-stream")])
async def test_root_follows_the_stream_field(http, base, stream, ctype):
    status, got, _ = await post(http, base + "/", {"inputs": Q, "parameters": {"max_new_tokens": 2}, "stream": stream})
    assert (status, got) == (200, ctype)


async def test_tokenize(http, base, tokenizer):
    text = "héllo wörld, 日本"
    status, _, out = await post(http, base + "/tokenize", {"inputs": text})
    tokens = json.loads(out)
    assert status == 200 and [t["id"] for t in tokens] == tokenizer.encode(text)
    data = text.encode()
    assert all(t["text"] == data[t["start"] : t["stop"]].decode("utf-8", "replace") for t in tokens)
    assert data[tokens[-1]["start"] : tokens[-1]["stop"]].decode() in text and tokens[-1]["stop"] == len(data)
    status, _, out = await post(http, base + "/tokenize", {"inputs": text, "parameters": {"truncate": 2}})
    assert json.loads(out) == tokens[-2:]
    status, _, out = await post(http, base + "/tokenize", {"parameters": {}})
    assert status == 422 and json.loads(out)["error_type"] == "validation"


async def test_info_and_health(http, base, core):
    async with http.get(base + "/info") as resp:
        assert resp.status == 200
        info = await resp.json()
    assert info["model_id"] == "tiny" and info["model_pipeline_tag"] == "text-generation"
    assert info["max_stop_sequences"] == core.config.max_stop_sequences
    assert info["max_input_tokens"] == info["max_total_tokens"] - 1 > 0
    assert info["max_best_of"] >= 1 and info["router"] == "trellis-gateway-lmi"
    for path in ("/health", "/"):
        async with http.get(base + path) as resp:
            assert resp.status == 200 and await resp.read() == b""


async def test_health_and_errors_without_a_core(http, start_gateway):
    down = await start_gateway("lmi", core="127.0.0.1:1")
    async with http.get(down + "/health") as resp:
        assert resp.status == 503
        assert await resp.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    async with http.get(down + "/info") as resp:
        assert resp.status == 503 and (await resp.json())["error_type"] == "unavailable"
    status, _, text = await post(http, down + "/generate", {"inputs": Q})
    assert status == 503 and json.loads(text)["error_type"] == "unavailable"


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/generate", {"inputs": Q, "parameters": {"top_k": "3"}}, "parameters.top_k"),
        ("/generate", {"inputs": Q, "parameters": {"unknown": 1}}, "parameters.unknown"),
        ("/generate", {"parameters": {}}, "inputs"),
        ("/generate", {"inputs": Q, "parameters": {"grammar": {"type": "ebnf", "value": "x"}}}, "parameters.grammar"),
        ("/generate", {"inputs": Q, "parameters": {"stop": [f"s{i}" for i in range(17)]}}, "parameters.stop"),
        ("/generate_stream", {"inputs": Q, "parameters": {"temperature": -1}}, "parameters.temperature"),
        ("/generate_stream", {"inputs": Q, "parameters": {"decoder_input_details": True}}, "decoder_input_details"),
        ("/generate_stream", {"inputs": Q, "parameters": {"best_of": 2, "do_sample": True}}, "parameters.best_of"),
    ],
)
async def test_validation_errors_are_422_in_tgi_shape(http, base, path, body, fragment):
    status, ctype, text = await post(http, base + path, body)
    assert (status, ctype) == (422, "application/json")
    out = json.loads(text)
    assert set(out) == {"error", "error_type"} and out["error_type"] == "validation"
    assert fragment in out["error"]


async def test_http_level_errors_in_tgi_shape(http, base, start_gateway):
    async with http.post(base + "/generate", data=b"{", headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 422 and (await resp.json())["error_type"] == "validation"
    async with http.post(base + "/generate", data=b"x", headers={"Content-Type": "text/plain"}) as resp:
        assert resp.status == 415 and (await resp.json())["error_type"] == "validation"
    async with http.put(base + "/generate", json={}) as resp:
        assert resp.status == 405 and (await resp.json())["error_type"] == "method_not_allowed"
    small = await start_gateway("lmi", max_body_bytes=64, batching="dynamic")
    async with http.post(small + "/generate", json={"inputs": "x" * 100}) as resp:
        assert resp.status == 413 and (await resp.json())["error_type"] == "validation"


async def test_full_queue_is_429_overloaded(http, start_mock_core, start_gateway):
    core = await start_mock_core(max_batch_size=1, max_queue_size=1, mock_step_ms=20.0)
    base = await start_gateway("lmi", core=core.address)
    body = {"inputs": Q, "parameters": {"max_new_tokens": 100}}
    results = await asyncio.gather(*(post(http, base + "/generate", body) for _ in range(4)))
    statuses = sorted(r[0] for r in results)
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    for status, _, text in results:
        if status == 429:
            assert json.loads(text)["error_type"] == "overloaded"


async def test_error_mid_stream_is_the_last_event(http, start_mock_core, start_gateway):
    doomed = await start_mock_core(mock_step_ms=5.0)
    base = await start_gateway("lmi", core=doomed.address)
    body = {"inputs": Q, "parameters": {"max_new_tokens": 1000}}
    try:
        async with http.post(base + "/generate_stream", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            await doomed.stop(0)  # the core goes away while the response streams
            text = first.decode() + (await resp.read()).decode()
    finally:
        await doomed.stop(0)
    events = parse_records(text, "sse")
    assert "token" in events[0]
    assert set(events[-1]) == {"error", "error_type"} and events[-1]["error_type"] in {"unavailable", "generation"}


# ------------------------------------------------------------------------------ OpenAI-compatible routes


async def test_openai_compatible_routes(http, base):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    status, _, text = await post(http, base + "/v1/chat/completions", chat)
    assert status == 200 and json.loads(text)["object"] == "chat.completion"
    status, ctype, text = await post(http, base + "/v1/chat/completions", {**chat, "stream": True})
    assert (status, ctype) == (200, "text/event-stream") and text.rstrip().endswith("data: [DONE]")
    status, _, text = await post(http, base + "/v1/completions", {"prompt": Q, "max_tokens": 3})
    assert status == 200 and json.loads(text)["object"] == "text_completion"
    status, _, text = await post(http, base + "/v1/completions", {"prompt": Q, "max_tokens": 0})
    assert status == 400 and "error" in json.loads(text)
    async with http.put(base + "/v1/completions", json={}) as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] is not None


# ------------------------------------------------------------------------------ a TGI client on DJL's routes


async def test_text_generation_client_on_invocations_without_tgi_compat(base):
    client = text_generation.AsyncClient(base + "/invocations", timeout=60)
    out = await client.generate(Q, max_new_tokens=4)
    texts = [r.token.text async for r in client.generate_stream(Q, max_new_tokens=4)]
    assert texts and "".join(texts) == out.generated_text


async def test_lmi_clients_keep_their_shapes_on_invocations(http, base):
    body = {"inputs": Q, "parameters": {"max_new_tokens": 2, "details": True}, "stream": True}
    status, ctype, text = await post(http, base + "/invocations", body)
    assert (status, ctype) == (200, "application/jsonlines")
    assert "log_prob" in parse_records(text, "jsonlines")[0]["token"]
    status, ctype, text = await post(http, base + "/invocations", body, {"Accept": "text/event-stream"})
    assert (status, ctype) == (200, "text/event-stream")
    assert "log_prob" in parse_records(text, "sse")[0]["token"]


# ------------------------------------------------------------------------------ the core's bound on stop strings


async def test_the_cores_stop_bound_is_a_400_in_each_lmi_shape(http, base, core):
    stops = [f"s{i}" for i in range(core.config.max_stop_sequences + 1)]
    bound = f"At most {core.config.max_stop_sequences} stop sequences"
    status, _, text = await post(http, base + "/invocations", {"inputs": Q, "parameters": {"stop_sequences": stops}})
    body = json.loads(text)
    assert status == 400 and body["details"]["finish_reason"] == "error"
    assert body["error"].startswith("parameters.stop_sequences:") and bound in body["error"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stop": stops}
    status, _, text = await post(http, base + "/invocations", chat)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "stop" and bound in error["message"]
    few = {"messages": [{"role": "user", "content": "Hi"}], "stop": stops[:5], "max_tokens": 2}
    status, _, _ = await post(http, base + "/invocations", few)  # OpenAI's 4 is not the bound
    assert status == 200
