"""`GET /openapi.json` on every gateway, kept honest: the document is valid OpenAPI 3.1, and real
responses of real gateways on the mock-engine core (JSON bodies, each SSE event and JSON line of
a stream, error bodies) validate against the schemas it gives (tests/integration/openapi_check.py).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import connect

from tests.integration.openapi_check import OpenApiDoc

pytestmark = pytest.mark.timeout(120)

KEY = "openapi-key"
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def fetch_doc(base: str) -> OpenApiDoc:
    async with aiohttp.ClientSession() as http, http.get(base + "/openapi.json") as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        return OpenApiDoc(await resp.json())


async def call(
    doc: OpenApiDoc, base: str, method: str, path: str, *, body: Any = None, data: bytes | None = None, **headers: str
) -> tuple[int, list[Any]]:
    """Make the request and check its response against `doc`; returns the status and the JSON
    items checked."""
    if body is not None:
        data = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    async with aiohttp.ClientSession() as http, http.request(method, base + path, data=data, headers=headers) as resp:
        raw = await resp.read()
        items = doc.check(method, path, resp.status, resp.headers.get("Content-Type", ""), raw, resp.headers)
        return resp.status, items


@pytest.fixture(scope="module")
async def gateways(mock_core, start_gateway):
    return {name: await start_gateway(name, core=mock_core.address) for name in ("openai", "lmi", "triton", "ws")}


@pytest.fixture(scope="module")
async def docs(gateways):
    return {name: await fetch_doc(base) for name, base in gateways.items()}


# --------------------------------------------------------------------------- every gateway


@pytest.mark.parametrize("name", ["openai", "lmi", "triton", "ws"])
async def test_each_document_is_openapi_3_1_with_metrics_and_itself(docs, gateways, name):
    doc = docs[name]
    assert doc.doc["openapi"] == "3.1.0" and "securitySchemes" not in doc.doc["components"]
    assert {"/metrics", "/openapi.json"} <= set(doc.doc["paths"])
    assert await call(doc, gateways[name], "GET", "/openapi.json") == (200, [doc.doc])
    status, _ = await call(doc, gateways[name], "GET", "/metrics")
    assert status == 200


@pytest.mark.parametrize("name", ["openai", "lmi", "triton", "ws"])
async def test_with_api_keys_the_document_is_open_and_declares_the_bearer_scheme(mock_core, start_gateway, name):
    base = await start_gateway(name, core=mock_core.address, api_key=(KEY,))
    doc = await fetch_doc(base)  # no key sent
    assert doc.doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "One of the gateway's --api-key keys.",
    }
    # The OpenAI gateway also takes Anthropic's x-api-key header (its /v1/messages clients send it).
    assert doc.doc["security"] == [{"bearer": []}, *([{"x-api-key": []}] if name == "openai" else [])]
    assert doc.doc["paths"]["/openapi.json"]["get"]["security"] == []
    generate = {"openai": "/v1/models", "lmi": "/invocations", "triton": "/v2", "ws": "/ws"}[name]
    method = "POST" if name == "lmi" else "GET"
    async with aiohttp.ClientSession() as http, http.request(method, base + generate) as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        doc.check(method, generate, 401, resp.headers["Content-Type"], await resp.read(), resp.headers)


async def test_overload_and_queue_timeout_answers_match_the_documents(start_mock_core, start_gateway):
    """A core whose queue takes nothing: 429 + Retry-After (OpenAI, Triton), 503 + Retry-After
    (LMI, every shape); a request that waits past --queue-timeout: 504."""
    core = await start_mock_core(max_queue_size=0)
    cases = [
        ("openai", {}, "/v1/chat/completions", CHAT, 429),
        ("openai", {}, "/v1/completions", {"prompt": "hi"}, 429),
        ("triton", {}, "/v2/models/mock/generate_stream", {"text_input": "hi"}, 429),
        ("lmi", {}, "/invocations", {"inputs": "hi"}, 503),
        ("lmi", {}, "/invocations", CHAT, 503),
        ("lmi", {"batching": "dynamic"}, "/invocations", {"inputs": ["a", "b"]}, 503),
    ]
    for name, options, path, body, status in cases:
        base = await start_gateway(name, core=core.address, **options)
        got, _ = await call(await fetch_doc(base), base, "POST", path, body=body)
        assert got == status, (name, path)

    core = await start_mock_core(max_batch_size=1, mock_step_ms=10)
    base = await start_gateway("openai", core=core.address, queue_timeout=0.3)
    doc = await fetch_doc(base)
    hold = {**CHAT, "max_tokens": 1000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(base + "/v1/chat/completions", json=hold) as held:
        await held.content.readline()
        status, [error] = await call(doc, base, "POST", "/v1/chat/completions", body=CHAT)
    assert status == 504 and error["error"]["code"] == "queue_timeout"


# --------------------------------------------------------------------------- OpenAI


async def test_openai_responses_match_the_document(docs, gateways):
    doc, base = docs["openai"], gateways["openai"]
    status, [completion] = await call(doc, base, "POST", "/v1/chat/completions", body={**CHAT, "logprobs": True})
    assert status == 200 and completion["object"] == "chat.completion"
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    status, chunks = await call(doc, base, "POST", "/v1/chat/completions", body=stream)
    assert status == 200 and len(chunks) >= 3 and chunks[-1]["usage"]["completion_tokens"] == 4
    status, [text] = await call(
        doc, base, "POST", "/v1/completions", body={"prompt": ["a", "b"], "max_tokens": 3, "logprobs": 1}
    )
    assert status == 200 and len(text["choices"]) == 2
    body = {"prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    status, chunks = await call(doc, base, "POST", "/v1/completions", body=body)
    assert status == 200 and chunks[-1]["usage"]["completion_tokens"] == 3
    assert (await call(doc, base, "GET", "/v1/models"))[0] == 200
    assert (await call(doc, base, "GET", "/v1/models/mock"))[0] == 200
    assert (await call(doc, base, "GET", "/health"))[0] == 200


async def test_openai_responses_api_matches_the_document(docs, gateways):
    doc, base = docs["openai"], gateways["openai"]
    body = {"model": "mock", "input": "hi", "max_output_tokens": 3, "metadata": {"k": "v"}}
    status, [response] = await call(doc, base, "POST", "/v1/responses", body=body)
    assert status == 200 and response["object"] == "response"
    status, events = await call(doc, base, "POST", "/v1/responses", body={**body, "stream": True})
    assert status == 200 and events[-1]["type"] == "response.incomplete"
    rid = response["id"]
    assert (await call(doc, base, "GET", f"/v1/responses/{rid}"))[0] == 200
    status, [items] = await call(doc, base, "GET", f"/v1/responses/{rid}/input_items?order=asc&limit=5")
    assert status == 200 and items["data"][0]["type"] == "message"
    assert (await call(doc, base, "GET", f"/v1/responses/{rid}/input_items?limit=0"))[0] == 400
    assert (await call(doc, base, "GET", f"/v1/responses/{rid}?stream=true"))[0] == 400
    assert (await call(doc, base, "DELETE", f"/v1/responses/{rid}"))[0] == 200
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        assert (await call(doc, base, method, f"/v1/responses/{rid}{path}"))[0] == 404
    chained = {**body, "previous_response_id": rid}
    assert (await call(doc, base, "POST", "/v1/responses", body=chained))[0] == 404
    assert (await call(doc, base, "POST", "/v1/responses", body={**body, "seed": 1}))[0] == 400


@pytest.mark.parametrize(
    "path, kwargs, status",
    [
        ("/v1/chat/completions", {"body": {**CHAT, "temperature": "hot"}}, 400),
        ("/v1/chat/completions", {"body": {**CHAT, "model": "other"}}, 404),
        ("/v1/chat/completions", {"data": b"{}", "Content-Type": "text/plain"}, 415),
        ("/v1/chat/completions", {"body": {**CHAT, "top_p": 7.0}}, 400),
        ("/v1/completions", {"body": {"prompt": "a", "best_of": 1, "n": 2}}, 400),
        ("/v1/completions", {"body": {"prompt": "a", "max_tokens": 10**9}}, 400),
        ("/v1/models/nothing", {}, 404),
    ],
)
async def test_openai_errors_match_the_document(docs, gateways, path, kwargs, status):
    method = "GET" if path.startswith("/v1/models") else "POST"
    got, [error] = await call(docs["openai"], gateways["openai"], method, path, **kwargs)
    assert got == status and error["error"]["message"]


MESSAGES = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_anthropic_messages_match_the_document(docs, gateways):
    doc, base = docs["openai"], gateways["openai"]
    status, [message] = await call(doc, base, "POST", "/v1/messages", body=MESSAGES)
    assert status == 200 and message["type"] == "message"
    status, events = await call(doc, base, "POST", "/v1/messages", body={**MESSAGES, "stream": True})
    assert status == 200 and events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    status, [count] = await call(
        doc, base, "POST", "/v1/messages/count_tokens", body={"model": "mock", "messages": MESSAGES["messages"]}
    )
    assert status == 200 and count["input_tokens"] > 0
    for body, expected in (({**MESSAGES, "max_tokens": "4"}, 400), ({**MESSAGES, "model": "other"}, 404)):
        status, [error] = await call(doc, base, "POST", "/v1/messages", body=body)
        assert status == expected and error["type"] == "error"


async def test_with_api_keys_messages_take_x_api_key(mock_core, start_gateway):
    base = await start_gateway("openai", core=mock_core.address, api_key=(KEY,))
    doc = await fetch_doc(base)
    status, [error] = await call(doc, base, "POST", "/v1/messages", body=MESSAGES)
    assert status == 401 and error["error"]["type"] == "authentication_error"
    status, _ = await call(doc, base, "POST", "/v1/messages", body=MESSAGES, **{"x-api-key": KEY})
    assert status == 200


async def test_a_body_over_the_limit_is_a_documented_413(mock_core, start_gateway):
    for name, path in (
        ("openai", "/v1/chat/completions"),
        ("lmi", "/invocations"),
        ("triton", "/v2/models/mock/generate"),
    ):
        base = await start_gateway(name, core=mock_core.address, max_body_bytes=64)
        doc = await fetch_doc(base)
        status, _ = await call(doc, base, "POST", path, data=b"x" * 100, **{"Content-Type": "application/json"})
        assert status == 413


# --------------------------------------------------------------------------- LMI


@pytest.mark.parametrize("accept", ["application/jsonlines", "text/event-stream"])
async def test_lmi_rolling_responses_match_the_document(docs, gateways, accept):
    doc, base = docs["lmi"], gateways["lmi"]
    params = {"max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    status, [whole] = await call(doc, base, "POST", "/invocations", body={"inputs": "hi", "parameters": params})
    assert status == 200 and whole["details"]["generated_tokens"] == 4
    body = {"inputs": "hi", "parameters": {**params, "decoder_input_details": False}, "stream": True}
    status, records = await call(doc, base, "POST", "/predictions/mock", body=body, Accept=accept)
    assert status == 200 and len(records) == 4 and "details" in records[-1]
    status, chunks = await call(doc, base, "POST", "/invocations", body={**CHAT, "stream": True}, Accept=accept)
    assert status == 200 and chunks[0]["object"] == "chat.completion.chunk"
    assert (await call(doc, base, "POST", "/invocations", body=CHAT))[0] == 200
    assert (await call(doc, base, "GET", "/ping"))[0] == 200


@pytest.mark.parametrize(
    "path, kwargs, status",
    [
        ("/invocations", {"body": {"parameters": {}}}, 424),
        ("/invocations", {"body": {"inputs": "hi", "parameters": {"top_p": 7.0}}}, 400),
        ("/invocations", {"data": b"inputs=hi", "Content-Type": "application/x-www-form-urlencoded"}, 415),
        ("/predictions/other", {"body": {"inputs": "hi"}}, 404),
        ("/invocations", {"body": {**CHAT, "temperature": "hot"}}, 400),
    ],
)
async def test_lmi_errors_match_the_document(docs, gateways, path, kwargs, status):
    got, [error] = await call(docs["lmi"], gateways["lmi"], "POST", path, **kwargs)
    assert got == status and error["error"]


async def test_lmi_tgi_and_dynamic_documents_follow_the_settings(mock_core, start_gateway):
    tgi = await start_gateway("lmi", core=mock_core.address, tgi_compat=True)
    doc = await fetch_doc(tgi)
    params = {"max_new_tokens": 3, "details": True, "decoder_input_details": True}
    status, [whole] = await call(doc, tgi, "POST", "/invocations", body={"inputs": "hi", "parameters": params})
    assert status == 200 and isinstance(whole, list) and "special" in whole[0]["details"]["tokens"][0]
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 3, "details": True}, "stream": True}
    status, records = await call(doc, tgi, "POST", "/invocations", body=body)
    assert status == 200 and len(records) == 3

    dynamic = await start_gateway("lmi", core=mock_core.address, batching="dynamic")
    doc = await fetch_doc(dynamic)
    body = {"inputs": ["a", "b"], "parameters": {"max_new_tokens": 3}}
    status, [whole] = await call(doc, dynamic, "POST", "/invocations", body=body)
    assert status == 200 and len(whole) == 2
    status, lines = await call(doc, dynamic, "POST", "/invocations", body={**body, "stream": True})
    assert status == 200 and lines and all(len(line["outputs"]) == 2 for line in lines)
    status, [error] = await call(doc, dynamic, "POST", "/invocations", body={"inputs": 3})
    assert status == 424 and error["message"] == "invoke handler failure"


# --------------------------------------------------------------------------- Triton


async def test_triton_responses_match_the_document(docs, gateways):
    doc, base = docs["triton"], gateways["triton"]
    body = {"id": "r1", "text_input": "hi", "max_tokens": 4, "parameters": {"return_log_probs": True}}
    status, [whole] = await call(doc, base, "POST", "/v2/models/mock/generate", body=body)
    assert status == 200 and whole["id"] == "r1" and len(whole["output_log_probs"]) == 4
    status, events = await call(doc, base, "POST", "/v2/models/mock/versions/1/generate_stream", body=body)
    assert status == 200 and events[-1]["finish_reason"] == "length"
    for path in ("/v2", "/v2/models/mock", "/v2/models/mock/versions/1", "/v2/models/mock/ready", "/v2/health/ready"):
        assert (await call(doc, base, "GET", path))[0] == 200, path
    assert (await call(doc, base, "GET", "/v2/health/live"))[0] == 200


@pytest.mark.parametrize(
    "method, path, kwargs, status",
    [
        ("POST", "/v2/models/mock/generate", {"body": {"text_input": 1}}, 400),
        ("POST", "/v2/models/mock/generate", {"body": {"text_input": "a", "nope": 1}}, 400),
        ("POST", "/v2/models/mock/generate_stream", {"body": {"text_input": "a", "top_p": 7.0}}, 400),
        ("POST", "/v2/models/other/generate", {"body": {"text_input": "a"}}, 404),
        ("POST", "/v2/models/mock/versions/0/generate", {"body": {"text_input": "a"}}, 400),
        ("GET", "/v2/models/other/ready", {}, 404),
        ("GET", "/v2/models/other", {}, 404),
    ],
)
async def test_triton_errors_match_the_document(docs, gateways, method, path, kwargs, status):
    got, [error] = await call(docs["triton"], gateways["triton"], method, path, **kwargs)
    assert got == status and error["error"]


# --------------------------------------------------------------------------- WebSocket


async def test_ws_http_answers_and_frames_match_the_document(docs, gateways):
    doc, base = docs["ws"], gateways["ws"]
    assert (await call(doc, base, "GET", "/health"))[0] == 200
    status, [error] = await call(doc, base, "GET", "/ws")
    assert status == 426 and error[0]["error"]
    frames = doc.operation("GET", "/api/ws")["x-websocket"]
    request = {"prompts": [{"request_id": "a", "prompt": "hi"}], "generation_config": {"max_new_tokens": 3}}
    assert not list(doc.validator(frames["clientFrame"]).iter_errors(request))
    server_frame = doc.validator(frames["serverFrame"])
    seen: set[str] = set()
    async with connect(base.replace("http", "ws") + "/api/ws") as ws:
        await ws.send(json.dumps(request))
        await ws.send(json.dumps({"prompts": []}))
        while "COMPLETE" not in seen or "error" not in seen:
            frame = json.loads(await ws.recv())
            errors = list(server_frame.iter_errors(frame))
            assert not errors, (frame, errors[0].message)
            seen |= {event.get("type", "error") for event in frame}
    assert {"ACCEPTED", "PROGRESS", "COMPLETE"} <= seen
