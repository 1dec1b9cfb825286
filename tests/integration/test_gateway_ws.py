"""The ws gateway end to end: a real core (the shared `core` fixture, HF engine on the tiny
model) and a real gateway on loopback, driven by the `websockets` client library.

Covers the seed's event sequence per prompt (batches of 1 and 4, both routes), stream_response
false, only_new_tokens false, defaults from a .env file, every refused-frame case, per-prompt
errors (num_beams, no session to continue, another socket holding the request_id, core down),
socket close and server shutdown cancelling every call, two batches in flight on one socket,
and the ping/pong keepalive. Failures only a stand-in core produces are tested in
test_gateway_core_failures.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import aiohttp
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import gateways.ws
from gateways.common.app import start_app
from gateways.common.config import GatewayConfig
from tests.golden.harness import GOLDEN
from tests.integration.core_helpers import wait_idle

WAIT = 60.0  # seconds a test waits for a frame before failing (a guard against hangs, not a timing check)
LONG = 1000  # new tokens: a generation that is still running when a test acts on it
SEED_EXAMPLE = GOLDEN / "ws" / "seed_example.json"
SEED_PAYLOAD = json.loads(SEED_EXAMPLE.read_text())["payload"]  # the seed's queue-generation payload
KEYS = {
    "ACCEPTED": {"request_id", "type"},
    "STARTED": {"request_id", "type"},
    "INITIALIZED": {"request_id", "type", "text"},
    "PROGRESS": {"request_id", "type", "text"},
    "COMPLETE": {"request_id", "type", "text", "is_eos", "new_tokens_count", "execution_time"},
    "ERROR": {"request_id", "type", "error"},
}


# ---------------------------------------------------------------------------------------- helpers


def ws_url(base: str, path: str = "/ws") -> str:
    """The WebSocket URL of a gateway started by `start_gateway` (http://host:port)."""
    return "ws" + base[len("http") :] + path


def batch(*prompts: tuple[str, str], **fields) -> dict:
    """A frame with (request_id, prompt) pairs and top-level fields."""
    return {"prompts": [{"request_id": rid, "prompt": text} for rid, text in prompts], **fields}


async def recv(ws) -> list:
    """The next frame, parsed; every frame of the protocol is a JSON array."""
    frame = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
    assert isinstance(frame, list) and frame, frame
    return frame


async def collect(ws, ids, frames: list | None = None) -> dict[str, list[dict]]:
    """Events per request_id until every id in `ids` has its COMPLETE or ERROR."""
    pending = set(ids)
    events: dict[str, list[dict]] = defaultdict(list)
    while pending:
        frame = await recv(ws)
        if frames is not None:
            frames.append(frame)
        for event in frame:
            assert set(event) == KEYS[event["type"]], event
            events[event["request_id"]].append(event)
            if event["type"] in ("COMPLETE", "ERROR"):
                pending.discard(event["request_id"])
    return dict(events)


async def run(ws, payload: dict, frames: list | None = None) -> dict[str, list[dict]]:
    """Send a batch and collect every prompt's events."""
    await ws.send(json.dumps(payload))
    return await collect(ws, [p["request_id"] for p in payload["prompts"]], frames)


async def refused(ws, frame: str | bytes) -> str:
    """Send a frame that must be refused; the answer's error text. Event frames of prompts
    already running on the socket may come first (the order of the two is not defined) and are
    skipped."""
    await ws.send(frame)
    answer = await recv(ws)
    while all("request_id" in entry for entry in answer):
        answer = await recv(ws)
    assert len(answer) == 1 and set(answer[0]) == {"error"}, answer
    assert isinstance(answer[0]["error"], str) and answer[0]["error"]
    return answer[0]["error"]


def check_lifecycle(events: list[dict], *, streaming: bool = True, max_new_tokens: int | None = None) -> dict:
    """Assert the seed's order ACCEPTED, STARTED, INITIALIZED, PROGRESS*, COMPLETE; return COMPLETE."""
    types = [e["type"] for e in events]
    assert types[:3] == ["ACCEPTED", "STARTED", "INITIALIZED"], types
    assert types[-1] == "COMPLETE", types
    middle = types[3:-1]
    assert set(middle) <= {"PROGRESS"}, types
    complete = events[-1]
    assert isinstance(complete["text"], str)
    assert isinstance(complete["is_eos"], bool)
    assert isinstance(complete["new_tokens_count"], int) and complete["new_tokens_count"] >= 1
    assert isinstance(complete["execution_time"], float) and complete["execution_time"] > 0
    if streaming:
        assert middle, "stream_response true must give PROGRESS events"
        assert all(e["text"] for e in events[3:-1])
    else:
        assert not middle
    if max_new_tokens is not None:
        assert complete["new_tokens_count"] == max_new_tokens  # the tiny model never reaches EOS here
    return complete


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"generation_config": {"do_sample": False, "max_new_tokens": max_new_tokens, **extra}}


# ---------------------------------------------------------------------------------------- fixtures


@pytest_asyncio.fixture(scope="module")
async def gateway(start_gateway) -> str:
    """The ws gateway on the shared core, with no .env file and the default limits."""
    return await start_gateway("ws", env_file="")


@pytest_asyncio.fixture(scope="module")
async def small_gateway(start_gateway) -> str:
    """A ws gateway with small limits (4 prompts per frame, 4 in flight, 64 KiB frames)."""
    return await start_gateway(
        "ws", env_file="", max_prompts_per_batch=4, max_in_flight_prompts=4, max_frame_bytes=64 * 1024
    )


# ---------------------------------------------------------------------------------------- event order


@pytest.mark.parametrize("size, path", [(1, "/ws"), (4, "/ws"), (4, "/api/ws")], ids=["1-ws", "4-ws", "4-api-ws"])
async def test_event_order_per_prompt(gateway, size, path):
    prompts = [(f"order-{size}-{path}-{i}", f"Prompt number {i} says") for i in range(size)]
    async with connect(ws_url(gateway, path)) as ws:
        events = await run(ws, batch(*prompts, **greedy(6)))
    assert set(events) == {rid for rid, _ in prompts}
    for rid, _ in prompts:
        complete = check_lifecycle(events[rid], max_new_tokens=6)
        assert events[rid][2]["text"] == ""  # INITIALIZED with only_new_tokens
        assert complete["text"] == "".join(e["text"] for e in events[rid][3:-1])
        assert complete["is_eos"] is False


async def test_seed_example_payload(gateway):
    """The seed's own payload (sampling, top_k 50, 100 new tokens): shapes, types and signs."""
    async with connect(ws_url(gateway)) as ws:
        events = await run(ws, SEED_PAYLOAD)
    complete = check_lifecycle(events["2835f3c5"])
    assert 1 <= complete["new_tokens_count"] <= 100


async def test_stream_response_false_sends_no_progress(gateway):
    async with connect(ws_url(gateway)) as ws:
        events = await run(
            ws, batch(("nostream-a", "Hello world"), ("nostream-b", "The cat"), stream_response=False, **greedy(5))
        )
    for rid in ("nostream-a", "nostream-b"):
        complete = check_lifecycle(events[rid], streaming=False, max_new_tokens=5)
        assert complete["text"]


async def test_only_new_tokens_false_puts_the_prompt_in_front(gateway):
    prompt = "Once upon a time"
    async with connect(ws_url(gateway)) as ws:
        events = await run(ws, batch(("full-a", prompt), only_new_tokens=False, **greedy(5)))
        new_only = await run(ws, batch(("full-b", prompt), **greedy(5)))
    evs = events["full-a"]
    complete = check_lifecycle(evs, max_new_tokens=5)
    assert evs[2]["text"] == prompt
    generated = "".join(e["text"] for e in evs[3:-1])
    assert complete["text"] == prompt + generated
    assert new_only["full-b"][-1]["text"] == generated  # greedy: the same continuation


async def test_two_batches_in_flight_on_one_socket(gateway):
    first = batch(("two-a1", "Hello world"), ("two-a2", "The cat sat on"), **greedy(40))
    second = batch(("two-b1", "Once upon a time"), **greedy(5))
    frames: list = []
    async with connect(ws_url(gateway)) as ws:
        await ws.send(json.dumps(first))
        await ws.send(json.dumps(second))
        events = await collect(ws, ["two-a1", "two-a2", "two-b1"], frames)
    check_lifecycle(events["two-a1"], max_new_tokens=40)
    check_lifecycle(events["two-a2"], max_new_tokens=40)
    check_lifecycle(events["two-b1"], max_new_tokens=5)
    order = [e["request_id"] for frame in frames for e in frame if e["type"] == "COMPLETE"]
    assert order.index("two-b1") < order.index("two-a1")  # the short second batch did not wait for the first
    assert any(len({e["request_id"] for e in frame}) > 1 for frame in frames)  # ready events shared frames


# ---------------------------------------------------------------------------------------- defaults from .env


async def test_defaults_from_env_file(start_gateway, tmp_path):
    env = tmp_path / "gateway.env"
    env.write_text("MODEL_DEFAULT_MAX_NEW_TOKENS=3\nMODEL_DEFAULT_DO_SAMPLE=false\n")
    url = await start_gateway("ws", env_file=str(env))
    async with connect(ws_url(url)) as ws:
        defaults = await run(ws, batch(("env-a", "Hello world")))
        explicit = await run(ws, batch(("env-b", "Hello world"), generation_config={"max_new_tokens": 5}))
    check_lifecycle(defaults["env-a"], max_new_tokens=3)
    check_lifecycle(explicit["env-b"], max_new_tokens=5)
    assert explicit["env-b"][-1]["text"].startswith(defaults["env-a"][-1]["text"])  # do_sample false applied


async def test_env_file_values_reach_the_core(start_gateway, tmp_path):
    env = tmp_path / "beams.env"
    env.write_text("MODEL_DEFAULT_NUM_BEAMS=2\nMODEL_DEFAULT_MAX_NEW_TOKENS=2\n")
    url = await start_gateway("ws", env_file=str(env))
    async with connect(ws_url(url)) as ws:
        from_env = await run(ws, batch(("beams-a", "Hello")))
        overridden = await run(ws, batch(("beams-b", "Hello"), generation_config={"num_beams": 1}))
    assert [e["type"] for e in from_env["beams-a"]] == ["ERROR"]
    assert from_env["beams-a"][0]["error"].startswith("generation_config.num_beams:")
    check_lifecycle(overridden["beams-b"], max_new_tokens=2)


# ---------------------------------------------------------------------------------------- refused frames

BAD_FRAMES = [
    ("not json", "{prompts", "The frame is not valid JSON"),
    ("not an object", "[]", "The frame must be a JSON object"),
    ("missing prompts", "{}", "prompts: is required."),
    ("prompts not an array", json.dumps({"prompts": "hello"}), "prompts: must be an array."),
    ("empty prompts", json.dumps({"prompts": []}), "prompts: must not be empty."),
    ("missing request_id", json.dumps({"prompts": [{"prompt": "x"}]}), "prompts[0].request_id: is required."),
    ("empty request_id", json.dumps(batch(("", "x"))), "prompts[0].request_id: must not be empty."),
    (
        "request_id not a string",
        json.dumps({"prompts": [{"request_id": 1, "prompt": "x"}]}),
        "prompts[0].request_id: must be a string.",
    ),
    (
        "prompt not a string",
        json.dumps({"prompts": [{"request_id": "x", "prompt": None}]}),
        "prompts[0].prompt: must be a string.",
    ),
    (
        "duplicate request_id",
        json.dumps(batch(("d", "x"), ("d", "y"))),
        "prompts[1].request_id: 'd' appears more than once in the batch",
    ),
    (
        "only_new_tokens not a boolean",
        json.dumps(batch(("x", "y"), only_new_tokens="false")),
        "only_new_tokens: must be true or false.",
    ),
    (
        "stream_response not a boolean",
        json.dumps(batch(("x", "y"), stream_response=0)),
        "stream_response: must be true or false.",
    ),
    (
        "generation_config not an object",
        json.dumps(batch(("x", "y"), generation_config=[1])),
        "generation_config: must be an object.",
    ),
    (
        "temperature not a number",
        json.dumps(batch(("x", "y"), generation_config={"temperature": "1"})),
        "generation_config.temperature: must be a number.",
    ),
    (
        "max_new_tokens not an integer",
        json.dumps(batch(("x", "y"), generation_config={"max_new_tokens": 2.5})),
        "generation_config.max_new_tokens: must be an integer.",
    ),
    (
        "unknown generation_config field",
        json.dumps(batch(("x", "y"), generation_config={"stop": ["."]})),
        "generation_config.stop: is not a field of this protocol.",
    ),
    (
        "too many prompts",
        json.dumps(batch(*[(f"m{i}", "x") for i in range(5)])),
        "prompts: the batch has 5 prompts; at most 4 are accepted per frame.",
    ),
]


@pytest.mark.parametrize("frame, message", [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES])
async def test_bad_frame_is_refused_and_the_socket_stays_open(small_gateway, frame, message, request):
    rid = f"after-bad-{request.node.callspec.id}"
    async with connect(ws_url(small_gateway)) as ws:
        assert (await refused(ws, frame)).startswith(message)
        events = await run(ws, batch((rid, "Hello"), **greedy(1)))
    check_lifecycle(events[rid], max_new_tokens=1)


async def test_binary_frame_is_refused(small_gateway):
    async with connect(ws_url(small_gateway)) as ws:
        assert (await refused(ws, b'{"prompts": []}')).startswith("Binary frames are not supported")
        check_lifecycle((await run(ws, batch(("after-bin", "Hello"), **greedy(1))))["after-bin"])


async def test_request_id_in_flight_on_the_socket_is_refused(small_gateway, core):
    async with connect(ws_url(small_gateway)) as ws:
        await ws.send(json.dumps(batch(("busy", "Hello world"), **greedy(LONG))))
        assert (await recv(ws))[0] == {"request_id": "busy", "type": "ACCEPTED"}
        error = await refused(ws, json.dumps(batch(("other", "x"), ("busy", "again"))))
        assert error.startswith("request_id: 'busy' is already in flight on this socket")
    await wait_idle(core.engine)


async def test_in_flight_limit_refuses_the_whole_batch(small_gateway, core):
    async with connect(ws_url(small_gateway)) as ws:
        await ws.send(json.dumps(batch(*[(f"lim{i}", "Hello world") for i in range(3)], **greedy(LONG))))
        error = await refused(ws, json.dumps(batch(("lim3", "x"), ("lim4", "y"))))
        assert error.startswith("prompts: 3 prompts are in flight on this socket and the batch adds 2; at most 4")
    await wait_idle(core.engine)


async def test_frame_over_the_size_limit_closes_with_1009(small_gateway):
    async with connect(ws_url(small_gateway), max_size=None) as ws:
        await ws.send(json.dumps(batch(("big", "x" * (65 * 1024)))))
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), WAIT)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


async def test_plain_http_request_gets_426(gateway):
    async with aiohttp.ClientSession() as http, http.get(gateway + "/ws") as resp:
        assert resp.status == 426
        assert resp.headers["Upgrade"] == "websocket"
        body = await resp.json()
    assert len(body) == 1 and body[0]["error"].startswith("This endpoint speaks the WebSocket batch protocol")


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/nothing", 404, "Not Found: GET /nothing"),
        ("POST", "/ws", 405, "Method Not Allowed: POST /ws"),
    ],
)
async def test_other_http_requests_get_the_protocols_error_shape(gateway, method, path, status, message):
    async with aiohttp.ClientSession() as http, http.request(method, gateway + path) as resp:
        assert (resp.status, resp.content_type) == (status, "application/json")
        assert await resp.json() == [{"error": message}]


# ---------------------------------------------------------------------------------------- per-prompt errors


async def test_num_beams_fails_only_that_batch(gateway):
    """The seed's ERROR example: num_beams > 1 on the HF engine; a batch already running goes on."""
    async with connect(ws_url(gateway)) as ws:
        await ws.send(json.dumps(batch(("beam-ok", "Hello world"), **greedy(30))))
        await ws.send(json.dumps(batch(("beam-x", "Hello"), ("beam-y", "Hi"), generation_config={"num_beams": 2})))
        events = await collect(ws, ["beam-ok", "beam-x", "beam-y"])
    for rid in ("beam-x", "beam-y"):
        assert [e["type"] for e in events[rid]] == ["ERROR"]
        assert events[rid][0]["error"] == (
            "generation_config.num_beams: num_beams=2 asks for beam search, which the hf engine does not support; "
            "use num_beams=1."
        )
    check_lifecycle(events["beam-ok"], max_new_tokens=30)


async def test_core_range_errors_name_the_protocol_field(gateway):
    async with connect(ws_url(gateway)) as ws:
        events = await run(ws, batch(("range", "Hello"), generation_config={"top_p": 1.5}))
    assert [e["type"] for e in events["range"]] == ["ERROR"]
    assert events["range"][0]["error"].startswith("generation_config.top_p: ")


async def test_empty_prompt_without_a_session_fails_only_that_prompt(gateway):
    async with connect(ws_url(gateway)) as ws:
        events = await run(ws, batch(("empty-new", ""), ("empty-ok", "Hello"), **greedy(2)))
    assert events["empty-new"] == [
        {
            "request_id": "empty-new",
            "type": "ERROR",
            "error": "prompt: the prompt is empty and there is no session for request_id 'empty-new' to continue; "
            "send a prompt.",
        }
    ]
    check_lifecycle(events["empty-ok"], max_new_tokens=2)


async def test_request_id_generating_on_another_socket(gateway, core):
    async with connect(ws_url(gateway)) as first, connect(ws_url(gateway)) as second:
        await first.send(json.dumps(batch(("shared-id", "Hello world"), **greedy(LONG))))
        assert (await recv(first))[0]["type"] == "ACCEPTED"
        events = await run(second, batch(("shared-id", "Hello world"), **greedy(2)))
    assert [e["type"] for e in events["shared-id"]] == ["ERROR"]
    assert events["shared-id"][0]["error"].startswith("request_id: 'shared-id' is already generating")
    await wait_idle(core.engine)


async def test_core_unreachable_is_a_per_prompt_error(start_gateway):
    url = await start_gateway("ws", env_file="", core="127.0.0.1:1")
    async with connect(ws_url(url)) as ws:
        events = await run(ws, batch(("down-a", "Hello"), ("down-b", "Hi")))
        assert await refused(ws, "nope")  # the socket itself keeps working
    for rid in ("down-a", "down-b"):
        assert [e["type"] for e in events[rid]] == ["ERROR"]
        assert events[rid][0]["error"]


# ---------------------------------------------------------------------------------------- cancellation


async def test_closing_the_socket_cancels_every_call(gateway, core):
    async with connect(ws_url(gateway)) as ws:
        await ws.send(json.dumps(batch(*[(f"close-{i}", "Hello world") for i in range(3)], **greedy(LONG))))
        await ws.send(json.dumps(batch(("close-late", "The cat"), **greedy(LONG))))
        seen: set[str] = set()
        while len(seen) < 4:  # every prompt is generating
            seen |= {e["request_id"] for e in await recv(ws) if e["type"] == "PROGRESS"}
        assert core.engine.stats().active > 0
    await wait_idle(core.engine)


async def test_dropped_connection_cancels_every_call(gateway, core):
    """The TCP connection goes away without a close handshake."""
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(ws_url(gateway))
        await ws.send_str(json.dumps(batch(("drop-a", "Hello world"), ("drop-b", "Hi"), **greedy(LONG))))
        while True:
            msg = await ws.receive(timeout=WAIT)
            if any(e["type"] == "PROGRESS" for e in json.loads(msg.data)):
                break
        ws._response.connection.transport.abort()  # no public API drops a connection without a close frame
    await wait_idle(core.engine)


async def test_server_shutdown_closes_sockets_with_1001(core):
    config = GatewayConfig(name="ws", core=core.address, options={"env_file": ""})
    runner, port = await start_app(gateways.ws.make_app(config), "127.0.0.1", 0)
    try:
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await ws.send(json.dumps(batch(("shutdown", "Hello world"), **greedy(LONG))))
            assert (await recv(ws))[0]["type"] == "ACCEPTED"
            await runner.cleanup()
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), WAIT)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1001
    finally:
        await runner.cleanup()
    await wait_idle(core.engine)


# ---------------------------------------------------------------------------------------- keepalive


async def test_client_ping_gets_a_pong(gateway):
    async with connect(ws_url(gateway), ping_interval=None) as ws:
        pong = await ws.ping()
        await asyncio.wait_for(pong, WAIT)


async def test_server_pings_and_drops_a_silent_peer(start_gateway):
    url = await start_gateway("ws", env_file="", heartbeat_seconds=0.2)
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(url), autoping=False) as ws:
        first = await ws.receive(timeout=WAIT)
        assert first.type is aiohttp.WSMsgType.PING
        while True:  # never answer: the gateway gives up on this peer
            msg = await ws.receive(timeout=WAIT)
            if msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSED,
                aiohttp.WSMsgType.CLOSING,
                aiohttp.WSMsgType.ERROR,
            ):
                break
            assert msg.type is aiohttp.WSMsgType.PING


# ---------------------------------------------------------------------------------------- core findings


async def test_concurrent_calls_with_the_same_request_id_both_complete(stub):
    req = spb.GenerateRequest(
        request_id="same-id-twice",
        text="Hello world",
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=LONG // 10),
    )

    async def call() -> int:
        msgs = [m async for m in stub.Generate(req)]
        return msgs[-1].usage.completion_tokens

    assert await asyncio.gather(call(), call()) == [LONG // 10, LONG // 10]
