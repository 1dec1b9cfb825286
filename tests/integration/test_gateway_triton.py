"""The Triton gateway end to end: raw HTTP (aiohttp) against a real gateway and a real core on loopback.

Covers both URL forms of generate and generate_stream, id echo, every parameter, unknown
parameters, JSON type errors, unknown model and version, stream/non-stream equality, log probs,
an error after the stream started, client disconnects (the core request is cancelled), KServe v2
health and metadata. The seed's examples are golden files (tests/golden/test_triton.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import aiohttp
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.server import start_core
from tests.conftest import core_config
from tests.golden.test_triton import sse_events
from tests.integration.core_helpers import wait_idle

PROMPT = "client input"
JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"


@pytest_asyncio.fixture(scope="module")
async def base(start_gateway) -> str:
    return await start_gateway("triton")


@pytest_asyncio.fixture(scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def _call(http, url: str, body=None, *, data: bytes | None = None) -> tuple[int, str, object]:
    """POST and decode: JSON bodies as objects, SSE bodies as event lists."""
    kwargs = {"data": data} if data is not None else {"json": body}
    async with http.post(url, **kwargs) as resp:
        text = await resp.text()
        ctype = resp.headers.get("Content-Type", "")
        if ctype.startswith("text/event-stream"):
            return resp.status, ctype, sse_events(text)
        return resp.status, ctype, json.loads(text) if text else None


async def _generate(http, base: str, body: dict, route: str = "generate") -> dict:
    status, _, obj = await _call(http, f"{base}/v2/models/tiny/{route}", body)
    assert status == 200, obj
    return obj


async def _next_event(resp: aiohttp.ClientResponse) -> dict:
    while True:
        line = await resp.content.readline()
        assert line, "stream ended before an event"
        if line.startswith(b"data: "):
            return json.loads(line[len(b"data: ") :])


# ----------------------------------------------------------------------------- routes and ids


@pytest.mark.parametrize("prefix", ["/v2/models/tiny", "/v2/models/tiny/versions/1"])
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize("rid", ["42", "", None])
async def test_both_url_forms_and_id_echo(http, base, prefix, route, rid):
    body = {"text_input": PROMPT, "max_tokens": 3}
    if rid is not None:
        body["id"] = rid
    status, ctype, out = await _call(http, f"{base}{prefix}/{route}", body)
    assert status == 200
    objects = out if route == "generate_stream" else [out]
    assert ctype == (SSE if route == "generate_stream" else "application/json; charset=utf-8")
    assert objects
    for obj in objects:
        assert ("id" in obj) == (rid is not None)
        assert obj.get("id") == rid
        assert (obj["model_name"], obj["model_version"]) == ("tiny", "1")
        assert isinstance(obj["text_output"], str)
    assert [("finish_reason" in o) for o in objects] == [False] * (len(objects) - 1) + [True]


async def test_stream_and_non_stream_agree_for_greedy(http, base):
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 12, "return_log_probs": True}}
    single = await _generate(http, base, body)
    events = await _generate(http, base, body, "generate_stream")
    assert "".join(e["text_output"] for e in events) == single["text_output"]
    streamed = [lp for e in events for lp in e["output_log_probs"]]
    assert streamed == pytest.approx(single["output_log_probs"])
    assert len(single["output_log_probs"]) == 12 or single["finish_reason"] == "stop"
    assert all(lp <= 0 for lp in streamed)
    assert single["cum_log_probs"] == pytest.approx(math.fsum(single["output_log_probs"]), abs=1e-3)
    running = 0.0
    for e in events:  # each event carries the running cumulative log prob
        running += math.fsum(e["output_log_probs"])
        assert e["cum_log_probs"] == pytest.approx(running, abs=1e-3)
    assert events[-1]["cum_log_probs"] == pytest.approx(single["cum_log_probs"], abs=1e-4)
    assert events[-1]["finish_reason"] == single["finish_reason"]


async def test_without_return_log_probs_there_are_none(http, base):
    for route in ("generate", "generate_stream"):
        out = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 2, "return_log_probs": False}, route)
        assert out
        for obj in out if isinstance(out, list) else [out]:
            assert "output_log_probs" not in obj and "cum_log_probs" not in obj


# ----------------------------------------------------------------------------- every parameter


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 4},
        {"max_new_tokens": 4.0},
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.9},
        {"top_p": 0},
        {"random_seed": 11, "top_k": 20},
        {"seed": 11, "top_k": 20},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"length_penalty": 1.0},
        {"min_length": 2},
        {"min_tokens": 2},
        {"stop_words": ["zzzz", ""]},
        {"stop": "zzzz"},
        {"bad_words": "zzzz"},
        {"beam_width": 1},
        {"end_id": 2},
        {"pad_id": 0},
        {"return_log_probs": True},
        {"exclude_input_in_output": True},
        {"include_stop_str_in_output": True},
        {"stream": True},
        {"stream": False},
        {"num_return_sequences": 1, "return_context_logits": False, "return_generation_logits": False},
    ],
    ids=lambda p: ",".join(p),
)
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_every_parameter_is_accepted(http, base, params, route):
    limit = {} if "max_new_tokens" in params else {"max_tokens": 4}
    out = await _generate(http, base, {"text_input": PROMPT, "parameters": {**limit, **params}}, route)
    last = out[-1] if isinstance(out, list) else out
    assert last["finish_reason"] in ("stop", "length")


async def test_greedy_settings_agree(http, base):
    """Unset, temperature 0 (the seed's example), top_k 1, top_p 0 (dropped) and pad_id all decode greedily."""
    plain = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 8})
    for params in ({"temperature": 0}, {"top_k": 1}, {"top_p": 0}, {"pad_id": 0}, {"stream": True}):
        out = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 8, **params})
        assert out["text_output"] == plain["text_output"], params


async def test_max_tokens_and_its_alias(http, base):
    for name in ("max_tokens", "max_new_tokens"):
        out = await _generate(http, base, {"text_input": PROMPT, name: 3, "return_log_probs": True})
        assert len(out["output_log_probs"]) == 3 and out["finish_reason"] == "length"


async def test_seed_makes_sampling_reproducible(http, base):
    texts = []
    for name in ("random_seed", "seed", "random_seed"):
        body = {"text_input": PROMPT, "max_tokens": 10, "top_k": 50, "temperature": 1.5, name: 1234}
        texts.append((await _generate(http, base, body))["text_output"])
    assert texts[0] == texts[1] == texts[2]


async def test_exclude_input_in_output_false_prepends_the_prompt(http, base):
    plain = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 4})
    body = {"text_input": PROMPT, "max_tokens": 4, "exclude_input_in_output": False}
    echoed = await _generate(http, base, body)
    assert echoed["text_output"] == PROMPT + plain["text_output"]
    events = await _generate(http, base, body, "generate_stream")
    assert events[0]["text_output"].startswith(PROMPT)
    assert "".join(e["text_output"] for e in events) == echoed["text_output"]


async def test_stop_words_end_the_output(http, base):
    text = (await _generate(http, base, {"text_input": PROMPT, "max_tokens": 12}))["text_output"]
    stop = text.strip()[-2:]
    cut = text.index(stop)
    for params in ({"stop_words": [stop]}, {"stop": stop}, {"stop_words": stop}):
        out = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 12, **params})
        assert (out["text_output"], out["finish_reason"]) == (text[:cut], "stop"), params
        events = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 12, **params}, "generate_stream")
        assert "".join(e["text_output"] for e in events) == text[:cut]
    kept = await _generate(
        http, base, {"text_input": PROMPT, "max_tokens": 12, "stop_words": stop, "include_stop_str_in_output": True}
    )
    assert kept["text_output"] == text[: cut + len(stop)]


async def test_bad_words_and_end_id_use_the_models_tokens(http, base, stub):
    req = spb.GenerateRequest(text=PROMPT, stopping=pb.StoppingParams(max_new_tokens=6))
    tokens = [t for m in [m async for m in stub.Generate(req)] for o in m.outputs for t in o.tokens]
    plain = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 6})
    banned = await _generate(http, base, {"text_input": PROMPT, "max_tokens": 6, "bad_words": [tokens[0].text]})
    assert banned["text_output"] != plain["text_output"]
    # end_id replaces the model's EOS: generation ends on it, and its text is not part of the output.
    second = tokens[1]
    body = {"text_input": PROMPT, "max_tokens": 6, "end_id": second.id, "return_log_probs": True}
    ended = await _generate(http, base, body)
    first_end = next(i for i, t in enumerate(tokens) if t.id == second.id)
    assert ended["text_output"] == "".join(t.text for t in tokens[:first_end])
    assert (ended["finish_reason"], len(ended["output_log_probs"])) == ("stop", first_end + 1)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"max_tokens": 5000}, "max_tokens: max_new_tokens must be in [1, 1024], got 5000."),
        ({"max_new_tokens": 0}, "max_new_tokens must be in [1, 1024], got 0."),
        ({"temperature": -1}, "temperature must be"),
        ({"temperature": 1e300}, "temperature must be a finite number"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be"),
        ({"repetition_penalty": 0}, "repetition_penalty must be"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"length_penalty": 2.0}, "length_penalty only applies to beam search"),
        ({"min_length": 5, "max_tokens": 2}, "min_length: min_new_tokens (5) must not exceed max_new_tokens (2)"),
        ({"min_tokens": -1}, "min_tokens: min_new_tokens must be"),
        ({"beam_width": 2}, "beam_width: num_beams=2 asks for beam search"),
        ({"beam_width": 0}, "beam_width: num_beams must be"),
        ({"end_id": 99999}, "end_id: "),
        ({"stop_words": ["a"] * 17}, "stop_words: At most 16 stop sequences"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_core_range_errors_name_the_clients_parameter(http, base, params, fragment, route):
    status, ctype, out = await _call(http, f"{base}/v2/models/tiny/{route}", {"text_input": PROMPT, **params})
    assert (status, ctype.split(";")[0]) == (400, JSON)
    assert list(out) == ["error"] and fragment in out["error"]


async def test_empty_prompt_is_refused_by_the_core(http, base):
    status, _, out = await _call(http, f"{base}/v2/models/tiny/generate", {"text_input": ""})
    assert status == 400 and out["error"].startswith("text_input: ")


# ----------------------------------------------------------------------------- shapes and types


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"text_input": PROMPT, "foo": 1}, "Unknown parameter 'foo'"),
        ({"text_input": PROMPT, "parameters": {"bar": True}}, "Unknown parameter 'bar'"),
        ({"text_input": PROMPT, "num_return_sequences": 2}, "'num_return_sequences' is not supported"),
        ({"text_input": PROMPT, "return_context_logits": True}, "'return_context_logits' is not supported"),
        ({"text_input": PROMPT, "temperature": "0.5"}, "'temperature' must be a number, got a string"),
        ({"text_input": PROMPT, "top_k": 2.5}, "'top_k' must be an integer, got 2.5"),
        ({"text_input": PROMPT, "max_tokens": "5"}, "'max_tokens' must be an integer, got a string"),
        ({"text_input": PROMPT, "return_log_probs": 1}, "'return_log_probs' must be a boolean, got a number"),
        ({"text_input": PROMPT, "stream": "yes"}, "'stream' must be a boolean"),
        ({"text_input": PROMPT, "stop_words": {"a": 1}}, "'stop_words' must be a string or an array of strings"),
        ({"text_input": PROMPT, "max_tokens": 1, "max_new_tokens": 1}, "same thing"),
        ({"id": 42, "text_input": PROMPT}, "'id' must be a string, got a number"),
        ({"text_input": ["a"]}, "'text_input' must be a string, got an array"),
        ({"parameters": {"max_tokens": 1}}, "no 'text_input'"),
        ({"text_input": PROMPT, "parameters": [1]}, "'parameters' must be an object"),
        ([PROMPT], "must be a JSON object"),
    ],
)
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_bad_requests_are_400_with_an_error_object(http, base, body, fragment, route):
    status, ctype, out = await _call(http, f"{base}/v2/models/tiny/{route}", body)
    assert (status, ctype.split(";")[0]) == (400, JSON)
    assert list(out) == ["error"] and fragment in out["error"]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "body is empty"),
        (b"{not json", "not valid JSON"),
        (b'{"text_input": "x", "temperature": NaN}', "NaN is not a valid JSON value"),
        (b'{"text_input": "\xff"}', "not valid UTF-8"),
    ],
)
async def test_unparsable_bodies_are_400(http, base, data, fragment):
    status, ctype, out = await _call(http, f"{base}/v2/models/tiny/generate", data=data)
    assert (status, ctype.split(";")[0]) == (400, JSON) and fragment in out["error"]


async def test_unknown_parameters_can_be_ignored_by_flag(http, start_gateway):
    lenient = await start_gateway("triton", ignore_unknown_parameters=True)
    out = await _generate(http, lenient, {"text_input": PROMPT, "max_tokens": 2, "foo": 1, "parameters": {"x": "y"}})
    assert out["finish_reason"] in ("stop", "length")
    status, _, err = await _call(http, f"{lenient}/v2/models/tiny/generate", {"text_input": PROMPT, "lora_task_id": 1})
    assert status == 400 and "lora_task_id" in err["error"]


async def test_body_over_the_limit_is_413(http, start_gateway):
    small = await start_gateway("triton", max_body_bytes=64)
    status, ctype, out = await _call(http, f"{small}/v2/models/tiny/generate", {"text_input": "x" * 200})
    assert (status, ctype.split(";")[0]) == (413, JSON)
    assert out == {"error": "The request body is larger than the limit of 64 bytes."}


async def test_unknown_routes_and_methods_answer_json(http, base):
    async with http.get(f"{base}/v2/nothing/here") as resp:
        assert (resp.status, await resp.json()) == (404, {"error": "Not Found: GET /v2/nothing/here"})
    async with http.get(f"{base}/v2/models/tiny/generate") as resp:
        assert (resp.status, await resp.json()) == (405, {"error": "Method Not Allowed: GET /v2/models/tiny/generate"})


# ----------------------------------------------------------------------------- model and version


@pytest.mark.parametrize(
    ("path", "status", "fragment"),
    [
        ("/v2/models/other", 404, "unknown model: 'other' is not found"),
        ("/v2/models/other/versions/1", 404, "unknown model: 'other' is not found"),
        ("/v2/models/tiny/versions/2", 404, "'tiny' version 2 is not found"),
        ("/v2/models/tiny/versions/0", 400, "version string '0'"),
        ("/v2/models/tiny/versions/latest", 400, "version string 'latest'"),
    ],
)
@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "", "/ready"])
async def test_unknown_model_or_version(http, base, path, status, fragment, route):
    method = http.post if route.startswith("/generate") else http.get
    async with method(f"{base}{path}{route}", json={"text_input": PROMPT}) as resp:
        assert (resp.status, resp.headers["Content-Type"].split(";")[0]) == (status, JSON)
        assert fragment in (await resp.json())["error"]


async def test_model_version_flag(http, start_gateway):
    v3 = await start_gateway("triton", model_version="3")
    out = await _generate(http, v3, {"text_input": PROMPT, "max_tokens": 1})
    assert out["model_version"] == "3"
    status, _, obj = await _call(
        http, f"{v3}/v2/models/tiny/versions/3/generate", {"text_input": PROMPT, "max_tokens": 1}
    )
    assert (status, obj["model_version"]) == (200, "3")
    status, _, _ = await _call(http, f"{v3}/v2/models/tiny/versions/1/generate", {"text_input": PROMPT})
    assert status == 404
    async with http.get(f"{v3}/v2/models/tiny") as resp:
        assert (await resp.json())["versions"] == ["3"]


# ----------------------------------------------------------------------------- health and metadata


async def test_health_and_metadata_while_serving(http, base):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready", "/v2/models/tiny/versions/1/ready"):
        async with http.get(base + path) as resp:
            assert (resp.status, await resp.read()) == (200, b""), path
    async with http.get(f"{base}/v2/models/tiny") as plain, http.get(f"{base}/v2/models/tiny/versions/1") as versioned:
        assert plain.status == versioned.status == 200
        assert await plain.json() == await versioned.json()


async def test_health_and_errors_without_a_core(http, start_gateway):
    orphan = await start_gateway("triton", core="127.0.0.1:1")
    async with http.get(f"{orphan}/v2/health/live") as resp:
        assert resp.status == 200
    async with http.get(f"{orphan}/v2/health/ready") as resp:
        assert (resp.status, await resp.read()) == (400, b"")
    async with http.get(f"{orphan}/v2/models/tiny/ready") as resp:
        assert resp.status == 400 and "not ready" in (await resp.json())["error"]
    async with http.get(f"{orphan}/v2") as resp:
        assert resp.status == 200 and (await resp.json())["extensions"] == ["generate"]
    for method, route in ((http.get, ""), (http.post, "/generate"), (http.post, "/generate_stream")):
        async with method(f"{orphan}/v2/models/tiny{route}", json={"text_input": PROMPT}) as resp:
            assert (resp.status, resp.headers["Content-Type"].split(";")[0]) == (503, JSON), route
            assert "model server" in (await resp.json())["error"]


async def test_ready_turns_400_when_the_core_stops_serving(http, start_gateway, tiny_model_dir):
    server = await start_core(core_config(tiny_model_dir, engine_process=False))
    try:
        url = await start_gateway("triton", core=server.address)
        async with http.get(f"{url}/v2/models/tiny/ready") as resp:
            assert resp.status == 200
        await server.health.enter_graceful_shutdown()
        async with http.get(f"{url}/v2/health/ready") as resp:
            assert resp.status == 400
        async with http.get(f"{url}/v2/models/tiny/ready") as resp:
            assert resp.status == 400 and "not serving" in (await resp.json())["error"]
    finally:
        await server.stop(0)


# ----------------------------------------------------------------------------- in-stream errors, cancellation


async def test_error_after_the_stream_started_is_an_sse_error_event(http, start_gateway, tiny_model_dir):
    server = await start_core(core_config(tiny_model_dir, engine_process=False))
    try:
        url = await start_gateway("triton", core=server.address)
        body = {"id": "e1", "text_input": PROMPT, "max_tokens": 1000}
        async with http.post(f"{url}/v2/models/tiny/generate_stream", json=body) as resp:
            assert (resp.status, resp.headers["Content-Type"]) == (200, SSE)
            first = await _next_event(resp)
            assert first["id"] == "e1" and "text_output" in first
            await server.engine.shutdown()
            rest = sse_events((await resp.read()).decode())
        assert rest, "no error event"
        assert list(rest[-1]) == ["error"] and isinstance(rest[-1]["error"], str) and rest[-1]["error"]
        assert all("finish_reason" not in e and "error" not in e for e in rest[:-1])
    finally:
        await server.stop(0)


@pytest.fixture
def aborts(core, monkeypatch) -> list[str]:
    """Request ids the shared core's engine is asked to abort during the test (the real abort runs)."""
    seen: list[str] = []
    real = core.engine.abort

    def abort(request_id: str) -> None:
        seen.append(request_id)
        real(request_id)

    monkeypatch.setattr(core.engine, "abort", abort)
    return seen


async def test_disconnect_mid_stream_cancels_the_core_request(http, base, core, aborts):
    await wait_idle(core.engine)
    body = {"text_input": PROMPT, "max_tokens": 1000}
    async with http.post(f"{base}/v2/models/tiny/generate_stream", json=body) as resp:
        await _next_event(resp)
        assert core.engine.stats().active == 1
        resp.close()  # drop the connection mid-stream
    await wait_idle(core.engine)
    assert len(aborts) == 1 and aborts[0].startswith("triton-")


async def test_disconnect_during_generate_cancels_the_core_request(base, core, aborts):
    await wait_idle(core.engine)

    async def call():
        async with aiohttp.ClientSession() as session:
            await session.post(f"{base}/v2/models/tiny/generate", json={"text_input": PROMPT, "max_tokens": 1000})

    task = asyncio.create_task(call())
    deadline = time.monotonic() + 30
    while core.engine.stats().active == 0:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
    task.cancel()  # closes the client's connection
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(core.engine)
    assert len(aborts) == 1 and aborts[0].startswith("triton-")
