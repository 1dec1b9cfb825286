"""The LMI gateway on a real core (HF engine, tiny model) and a real gateway on loopback:
parameters honoured end to end, jsonlines and SSE streaming, TGI compatibility with the real
`text-generation` client, dynamic batching, chat on /invocations, every error row that needs a
live core (unreachable, overloaded, mid-stream failure, body too large), and cancellation on
client disconnect."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
import text_generation
from text_generation.errors import BadRequestError

from core.server import start_core
from tests.conftest import core_config
from tests.golden.harness import match
from tests.golden.test_lmi import check_records, load_case, parse_records
from tests.integration.core_helpers import wait_idle

Q = "What is Deep Learning?"
ERROR_BODY = {
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None},
    "error": "<str>",
}


@pytest_asyncio.fixture(scope="module")
async def lmi(start_gateway) -> str:
    """The default (rolling batch, jsonlines) gateway on the shared core."""
    return await start_gateway("lmi")


@pytest_asyncio.fixture(scope="module")
async def tgi(start_gateway) -> str:
    """A TGI-compatible gateway on the shared core."""
    return await start_gateway("lmi", tgi_compat=True)


@pytest_asyncio.fixture(scope="module")
async def dynamic(start_gateway) -> str:
    """A dynamic-batch gateway on the shared core."""
    return await start_gateway("lmi", batching="dynamic")


@pytest_asyncio.fixture(scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http, url: str, body, headers=None) -> tuple[int, str, str]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.text()


async def greedy(http, base: str, inputs: str = Q, **params) -> dict:
    params.setdefault("max_new_tokens", 6)
    params.setdefault("ignore_eos_token", True)
    status, _, text = await post(http, base + "/invocations", {"inputs": inputs, "parameters": params})
    assert status == 200, text
    return json.loads(text)


# ------------------------------------------------------------------------------ rolling batch


async def test_stream_carries_the_same_text_as_non_streaming(http, lmi):
    body = {"inputs": Q, "parameters": {"max_new_tokens": 6, "ignore_eos_token": True, "details": True}}
    status, ctype, text = await post(http, lmi + "/invocations", {**body, "stream": True})
    assert (status, ctype) == (200, "application/jsonlines")
    records = parse_records(text, "jsonlines")
    check_records(load_case("rolling_jsonlines_stream")["response"]["records"], records)
    full = await greedy(http, lmi, details=True)
    assert records[-1]["generated_text"] == full["generated_text"]
    assert [r["token"]["id"] for r in records] == [t["id"] for t in full["details"]["tokens"]]


async def test_return_full_text_prepends_the_prompt(http, lmi):
    plain = await greedy(http, lmi)
    full = await greedy(http, lmi, return_full_text=True)
    assert full["generated_text"] == Q + plain["generated_text"]


async def test_stop_sequence_and_stop_token_ids(http, lmi):
    # A seeded sample gives varied text, and the same tokens again up to where a stop ends it.
    seeded = {"do_sample": True, "seed": 11, "details": True}
    first = await greedy(http, lmi, **seeded)
    tokens = first["details"]["tokens"]
    i = next(i for i, t in enumerate(tokens) if i > 0 and t["id"] not in {x["id"] for x in tokens[:i]})
    by_id = await greedy(http, lmi, **seeded, stop_token_ids=[tokens[i]["id"]])
    assert by_id["details"]["finish_reason"] == "stop_sequence"
    assert by_id["details"]["generated_tokens"] == i + 1
    stop = tokens[i]["text"]
    assert stop and stop not in "".join(t["text"] for t in tokens[:i])
    by_text = await greedy(http, lmi, **seeded, stop_sequences=[stop])
    assert by_text["details"]["finish_reason"] == "stop_sequence"
    assert by_text["generated_text"] == "".join(t["text"] for t in tokens[:i])
    kept = await greedy(http, lmi, **seeded, stop_sequences=[stop], include_stop_str_in_output=True)
    assert kept["generated_text"] == "".join(t["text"] for t in tokens[: i + 1])


async def test_bad_sequences_and_min_length_are_honoured(http, lmi):
    # The first token greedy decoding picks after "Hello" is a whole word: one picked after a byte
    # of a multi-byte character has the text "\ufffd", which spells no token to ban.
    first = await greedy(http, lmi, "Hello", details=True)
    banned = first["details"]["tokens"][0]["text"]
    other = await greedy(http, lmi, "Hello", details=True, bad_sequences=[banned])
    assert other["details"]["tokens"][0]["text"] != banned
    eos_allowed = await greedy(http, lmi, details=True, ignore_eos_token=False, min_length=4, max_new_tokens=4)
    assert eos_allowed["details"]["generated_tokens"] == 4


async def test_every_backend_parameter_is_accepted(http, lmi):
    params = {
        "do_sample": True,
        "seed": 1234,
        "temperature": 0.8,
        "repetition_penalty": 1.1,
        "top_k": -1,
        "top_p": 0.9,
        "max_new_tokens": 5,
        "details": True,
        "return_full_text": False,
        "stop_sequences": ["\n\n\n"],
        "decoder_input_details": True,
        "typical_p": 0.95,
        "truncate": 4,
        "ignore_eos_token": True,
        "min_p": 0.01,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "n": 1,
        "best_of": 1,
        "num_beams": 1,
        "length_penalty": 1.0,
        "early_stopping": False,
        "stop_token_ids": [3],
        "include_stop_str_in_output": False,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "min_length": 1,
        "bad_sequences": ["zzzz"],
        "stop": False,
        "top_n_tokens": 2,
    }
    status, _, text = await post(http, lmi + "/invocations", {"inputs": Q, "parameters": params})
    assert status == 200, text
    details = json.loads(text)["details"]
    assert len(details["prefill"]) == 4  # truncate keeps the last 4 prompt tokens
    assert details["prefill"][0]["log_prob"] is None  # the first prompt token has no logprob
    assert all(len(p["top_tokens"]) == 1 for p in details["prefill"][1:])
    assert all(len(t) == 2 for t in details["top_tokens"])
    again = json.loads((await post(http, lmi + "/invocations", {"inputs": Q, "parameters": params}))[2])
    assert again["generated_text"] == json.loads(text)["generated_text"]  # same seed, same text


async def test_decoder_input_details_gives_prefill(http, lmi):
    out = await greedy(http, lmi, decoder_input_details=True)
    prefill = out["details"]["prefill"]
    assert prefill[0]["log_prob"] is None  # the first prompt token has no logprob
    assert all(p["log_prob"] <= 0 for p in prefill[1:])
    assert "".join(p["text"] for p in prefill[1:]) == Q


async def test_best_of_returns_the_most_likely_sequence(http, lmi):
    out = await greedy(http, lmi, n=3, do_sample=True, seed=5, max_new_tokens=4)
    others = out["details"]["best_of_sequences"]
    assert len(others) == 2

    def score(seq):
        return sum(t["log_prob"] for t in seq["tokens"])

    assert all(score(out["details"]) >= score(o) - 1e-4 for o in others)
    for o in others:
        assert set(o) == {"generated_text", "finish_reason", "generated_tokens", "tokens"}


@pytest.mark.parametrize(
    ("params", "stream", "param"),
    [
        ({"num_beams": 2}, False, "parameters.num_beams"),  # the HF engine has no beam search
        ({"n": 2}, True, "parameters.n"),
        ({"stop": True}, False, "parameters.stop"),
        ({"watermark": True}, True, "parameters.watermark"),
        ({"temperature": -0.5}, True, "parameters.temperature"),
        ({"top_n_tokens": 50}, False, "parameters.top_n_tokens"),
        ({"min_length": 9, "max_new_tokens": 3}, False, "parameters.min_length"),
        ({"n": 2, "best_of": 0}, False, "parameters.best_of"),
        ({"n": 0}, False, "parameters.n"),
        ({"truncate": 0}, False, "parameters.truncate"),
        ({"bad_sequences": [""]}, False, "parameters.bad_sequences"),
    ],
)
async def test_unusable_parameters_are_refused_by_name(http, lmi, params, stream, param):
    status, ctype, text = await post(http, lmi + "/invocations", {"inputs": Q, "parameters": params, "stream": stream})
    assert (status, ctype) == (400, "application/json"), text
    body = json.loads(text)
    match(ERROR_BODY, body)
    assert body["error"].startswith(param + ":")


@pytest.mark.parametrize(
    ("headers", "options", "ctype"),
    [
        ({"Accept": "text/event-stream"}, {}, "text/event-stream"),
        ({}, {"output_formatter": "sse"}, "text/event-stream"),
        ({}, {"tgi_compat": True}, "text/event-stream"),
        ({"Accept": "application/jsonlines"}, {"tgi_compat": True}, "application/jsonlines"),
        ({}, {"tgi_compat": True, "output_formatter": "jsonlines"}, "application/jsonlines"),
    ],
)
async def test_output_formatter_choice(http, start_gateway, headers, options, ctype):
    base = await start_gateway("lmi", **options)
    body = {"inputs": Q, "parameters": {"max_new_tokens": 3}, "stream": True}
    status, got, text = await post(http, base + "/invocations", body, headers)
    assert (status, got) == (200, ctype)
    records = parse_records(text, "sse" if ctype == "text/event-stream" else "jsonlines")
    assert "generated_text" in records[-1]


async def test_predictions_route(http, lmi):
    status, _, text = await post(http, lmi + "/predictions/tiny", {"inputs": Q, "parameters": {"max_new_tokens": 2}})
    assert status == 200 and "generated_text" in json.loads(text)
    status, _, text = await post(http, lmi + "/predictions/other", {"inputs": Q})
    assert status == 404
    assert json.loads(text) == {"error": "Model not found: 'other'; this server serves 'tiny'.", "code": 404}


# ------------------------------------------------------------------------------ errors needing special setups


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/nothing", 404, "Not Found: GET /nothing"),
        ("GET", "/invocations", 405, "Method Not Allowed: GET /invocations"),
        ("POST", "/ping", 405, "Method Not Allowed: POST /ping"),
    ],
)
async def test_unknown_paths_and_methods_answer_in_the_lmi_shape(http, lmi, dynamic, method, path, status, message):
    for base in (lmi, dynamic):
        async with http.request(method, base + path) as resp:
            assert (resp.status, resp.content_type) == (status, "application/json")
            assert await resp.json() == {"error": message, "code": status}


async def test_body_over_the_limit_is_413(http, start_gateway):
    base = await start_gateway("lmi", max_body_bytes=1024)
    status, ctype, text = await post(http, base + "/invocations", {"inputs": "x" * 2000})
    assert (status, ctype) == (413, "application/json")
    assert json.loads(text) == {"error": "The request body is larger than the limit of 1024 bytes.", "code": 413}
    dyn = await start_gateway("lmi", max_body_bytes=1024, batching="dynamic")
    status, _, text = await post(http, dyn + "/invocations", {"inputs": ["x" * 2000]})
    assert status == 413
    assert json.loads(text)["message"] == "invoke handler failure"


async def test_core_unreachable_is_503(http, start_gateway):
    base = await start_gateway("lmi", core="127.0.0.1:1")
    async with http.get(base + "/ping") as resp:
        assert resp.status == 503
        assert await resp.json() == {"status": "Unhealthy"}
    for stream in (False, True):
        status, _, text = await post(http, base + "/invocations", {"inputs": Q, "stream": stream})
        assert status == 503
        match(ERROR_BODY, json.loads(text))
    status, _, text = await post(http, base + "/predictions/tiny", {"inputs": Q})
    assert status == 503


async def test_ping(http, lmi):
    async with http.get(lmi + "/ping") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "Healthy"}


async def test_full_queue_is_503(http, start_gateway, tiny_model_dir):
    small = await start_core(core_config(tiny_model_dir, max_batch_size=1, max_queue_size=1, engine_process=False))
    try:
        base = await start_gateway("lmi", core=small.address)
        body = {"inputs": Q, "parameters": {"max_new_tokens": 300, "ignore_eos_token": True}}
        results = await asyncio.gather(*(post(http, base + "/invocations", body) for _ in range(4)))
        statuses = sorted(r[0] for r in results)
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        for status, _, text in results:
            if status == 503:
                match(ERROR_BODY, json.loads(text))
    finally:
        await small.stop(0)


async def test_error_mid_stream_is_the_last_line(http, start_gateway, tiny_model_dir):
    case = load_case("error_in_stream")
    doomed = await start_core(core_config(tiny_model_dir, engine_process=False))
    try:
        base = await start_gateway("lmi", core=doomed.address)
        async with http.post(base + case["request"]["path"], json=case["request"]["body"]) as resp:
            assert resp.status == case["response"]["status"]
            assert resp.content_type == case["response"]["content_type"]
            first = await resp.content.readline()
            await doomed.stop(0)  # the core goes away while the response streams
            text = first.decode() + (await resp.read()).decode()
    finally:
        await doomed.stop(0)
    check_records(case["response"]["records"], parse_records(text, "jsonlines"))


async def test_dynamic_error_mid_stream_is_the_last_line(http, start_gateway, tiny_model_dir):
    doomed = await start_core(core_config(tiny_model_dir, engine_process=False))
    body = {"inputs": [Q, "Hello"], "parameters": {"max_new_tokens": 1000, "ignore_eos_token": True}, "stream": True}
    try:
        base = await start_gateway("lmi", core=doomed.address, batching="dynamic")
        async with http.post(base + "/invocations", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            await doomed.stop(0)
            text = first.decode() + (await resp.read()).decode()
    finally:
        await doomed.stop(0)
    records = parse_records(text, "jsonlines")
    assert all(len(r["outputs"]) == 2 for r in records[:-1])
    match({"code": "<int>", "message": "invoke handler failure", "error": "<str>"}, records[-1])


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"inputs": "x", "parameters": {"temperature": NaN}}', "NaN is not a valid JSON value"),
        (b'{"inputs": "\xff"}', "not valid UTF-8"),
        (b'["What is Deep Learning?"]', "must be a JSON object"),
        (b"", "not valid JSON"),
    ],
)
async def test_malformed_bodies_are_424(http, lmi, raw, fragment):
    async with http.post(lmi + "/invocations", data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 424
        body = await resp.json()
    assert body["code"] == 424 and fragment in body["error"]


async def test_disconnect_cancels_the_core_request(http, lmi, core, monkeypatch):
    # The engine is called with abort() only for a request that did not run to its end, so
    # recording the calls (and passing them on) tells a cancel from a natural finish.
    aborted = []
    real_abort = core.engine.abort
    monkeypatch.setattr(core.engine, "abort", lambda rid: (aborted.append(rid), real_abort(rid)))
    await wait_idle(core.engine)
    body = {"inputs": Q, "parameters": {"max_new_tokens": 1000, "ignore_eos_token": True}, "stream": True}
    resp = await http.post(lmi + "/invocations", json=body)
    assert resp.status == 200
    await resp.content.readline()
    assert core.engine.stats().active == 1
    resp.close()  # drop the connection mid-stream
    await wait_idle(core.engine)
    assert len(aborted) == 1


# ------------------------------------------------------------------------------ TGI compatibility


async def test_tgi_client_sync(tgi):
    client = text_generation.Client(tgi + "/invocations", timeout=60)
    out = await asyncio.to_thread(client.generate, Q, max_new_tokens=5, decoder_input_details=True, top_n_tokens=2)
    assert out.details.finish_reason.value in {"length", "eos_token"}
    assert out.details.generated_tokens == len(out.details.tokens)
    assert out.details.prefill[0].logprob is None and len(out.details.prefill) > 1
    assert len(out.details.top_tokens) == len(out.details.tokens)
    assert "".join(t.text for t in out.details.tokens) == out.generated_text

    def stream():
        return list(client.generate_stream(Q, max_new_tokens=5))

    chunks = await asyncio.to_thread(stream)
    assert chunks[-1].details is not None and chunks[-1].generated_text == out.generated_text
    assert all(c.details is None for c in chunks[:-1])
    assert "".join(c.token.text for c in chunks if not c.token.special) == out.generated_text


async def test_tgi_client_async(tgi):
    client = text_generation.AsyncClient(tgi + "/invocations", timeout=60)
    out = await client.generate(Q, max_new_tokens=4, do_sample=True, seed=3, stop_sequences=["\n\n\n"])
    assert out.details.seed == 3 and out.details.generated_tokens == len(out.details.tokens)
    best = await client.generate(Q, max_new_tokens=3, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1
    texts = [r.token.text async for r in client.generate_stream(Q, max_new_tokens=4, do_sample=True, seed=3)]
    assert "".join(texts) == out.generated_text  # same seed, same text, streamed


async def test_tgi_client_errors(tgi):
    client = text_generation.AsyncClient(tgi + "/invocations", timeout=60)
    with pytest.raises(BadRequestError, match="max_new_tokens"):
        await client.generate(Q, max_new_tokens=0)
    with pytest.raises(BadRequestError, match="max_new_tokens"):
        async for _ in client.generate_stream(Q, max_new_tokens=0):
            pass


# ------------------------------------------------------------------------------ dynamic batch


async def test_dynamic_batch_answers_in_input_order(http, lmi, dynamic):
    inputs = ["What is Deep Learning", "How many ways can I peel an orange", "Hello"]
    params = {"max_new_tokens": 5, "ignore_eos_token": True}
    status, _, text = await post(http, dynamic + "/invocations", {"inputs": inputs, "parameters": params})
    assert status == 200
    got = [r["generated_text"] for r in json.loads(text)]
    expected = [(await greedy(http, lmi, x, max_new_tokens=5))["generated_text"] for x in inputs]
    assert got == expected


async def test_dynamic_batch_streams_outputs(http, dynamic):
    inputs = ["What is Deep Learning", "Hello"]
    params = {"max_new_tokens": 5, "ignore_eos_token": True, "return_full_text": True}
    status, _, text = await post(http, dynamic + "/invocations", {"inputs": inputs, "parameters": params})
    expected = [r["generated_text"] for r in json.loads(text)]
    status, ctype, text = await post(
        http, dynamic + "/invocations", {"inputs": inputs, "parameters": params, "stream": True}
    )
    assert (status, ctype) == (200, "application/jsonlines")
    records = parse_records(text, "jsonlines")
    assert all(len(r["outputs"]) == 2 for r in records)
    assert ["".join(r["outputs"][i] for r in records) for i in range(2)] == expected
    assert expected[0].startswith("What is Deep Learning")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"inputs": "x", "parameters": {"details": True}}, "parameters.details"),
        ({"inputs": ["x", "y"], "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ({"inputs": "x", "parameters": {"top_k": "3"}}, "parameters.top_k"),
        ({"nothing": 1}, "inputs"),
    ],
)
async def test_dynamic_batch_errors_are_424(http, dynamic, body, fragment):
    for stream in (False, True):
        status, _, text = await post(http, dynamic + "/invocations", {**body, "stream": stream})
        assert status == 424
        out = json.loads(text)
        assert out["code"] == 424 and out["message"] == "invoke handler failure"
        assert fragment in out["error"]


# ------------------------------------------------------------------------------ chat on /invocations

CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is deep learning?"},
    ],
    "logprobs": True,
    "top_logprobs": 1,
    "max_tokens": 6,
}


async def test_chat_on_invocations(http, lmi):
    status, ctype, text = await post(http, lmi + "/invocations", CHAT)
    assert (status, ctype) == (200, "application/json"), text
    body = json.loads(text)
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in {"length", "eos_token", "stop_sequence"}
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("headers", "framing"),
    [({}, "jsonlines"), ({"Accept": "text/event-stream"}, "sse")],
)
async def test_chat_streams_as_jsonlines_or_sse(http, lmi, headers, framing):
    status, ctype, text = await post(http, lmi + "/invocations", {**CHAT, "stream": True}, headers)
    assert status == 200
    assert ctype == ("text/event-stream" if framing == "sse" else "application/jsonlines")
    if framing == "sse":
        assert text.rstrip().endswith("data: [DONE]")
        text = text.rstrip()[: -len("data: [DONE]")]
    chunks = parse_records(text, framing)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals and finals[-1] in {"length", "eos_token", "stop_sequence"}
