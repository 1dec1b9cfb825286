"""Coalescing under backpressure changes nothing a client reads.

A client that reads slower than tokens come makes the server merge what waits: into fewer
Generate messages (gRPC flow control), into one MultiplexGenerate message per write, into one
HTTP write of several records, into one WebSocket array. Here every path gets a slow reader
(small socket buffers and a pause in reading while a long greedy generation on a fast mock
engine runs) and must deliver exactly the tokens, text, logprobs, finish and record framing of
the same request read promptly.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import socket
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from aiohttp import web
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from core import multiplex
from gateways.common.config import GatewayConfig, load
from tests.integration.core_helpers import generate, request, wait_idle
from tests.integration.test_multiplex import Mux, _shape

TOKENS = 3000
PAUSE_S = 1.0
#: HTTP and WebSocket: the gateway's transport buffers 64 KiB before it pauses.
LONG_PAUSE_S = 2.0
SMALL_BUFFER = 4096
#: A client that announces a small HTTP/2 window and never grows it (no BDP probing), so the
#: server's writes wait once the window is full.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]


async def _stall(core, seconds: float) -> None:
    """The slow reader's pause: at least `seconds`, and until the engine has generated every
    token of the request, so that all of it waits in the server while nobody reads, however
    slowly a loaded machine runs the engine."""
    await asyncio.sleep(seconds)
    await wait_idle(core.engine)


@pytest_asyncio.fixture(scope="module")
async def fast_core(start_mock_core):
    """A mock core whose steps run back to back, with a long context (a long generation finishes
    quickly)."""
    return await start_mock_core(mock_step_ms=0, mock_context_length=8192)


@pytest_asyncio.fixture(scope="module")
async def gateways(fast_core):
    """Every gateway in front of fast_core, listening with a small send buffer, so a client that
    stops reading pauses the gateway's transport soon."""
    runners, ports = [], {}
    for name in ("lmi", "openai", "triton", "ws"):
        module = importlib.import_module(f"gateways.{name}")
        options = dict(load(name, module.DEFAULT_PORT, module.add_arguments, [], {}).options)
        if name == "ws":
            options["env_file"] = ""
        config = GatewayConfig(name=name, core=fast_core.address, host="127.0.0.1", port=0, options=options)
        runner = web.AppRunner(module.make_app(config), handler_cancellation=True, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        await web.SockSite(runner, sock).start()
        runners.append(runner)
        ports[name] = sock.getsockname()[1]
    yield ports
    for runner in runners:
        await runner.cleanup()


# --------------------------------------------------------------------------------- gRPC


async def test_generate_merges_messages_for_a_slow_reader_and_loses_nothing(fast_core):
    body = {
        "text": "Once upon a time",
        "stopping": {"maxNewTokens": TOKENS, "ignoreEos": True},
        "output": {"logprobs": True, "topLogprobs": 3},
    }
    async with grpc.aio.insecure_channel(fast_core.address, options=SMALL_WINDOW) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        prompt = await generate(stub, body)
        call = stub.Generate(request(body))
        slow = [await call.read()]
        await _stall(fast_core, PAUSE_S)
        while (msg := await call.read()) is not grpc.aio.EOF:
            slow.append(msg)
    assert _shape(slow) == _shape(prompt)
    assert sum(len(o.tokens) for m in slow for o in m.outputs) == TOKENS
    # Merged while the reader paused: many tokens in some messages, fewer messages in all.
    assert max(len(o.tokens) for m in slow for o in m.outputs) > 10
    assert len(slow) < len(prompt) - 100


@pytest.mark.parametrize(
    ("output", "steps", "max_entries"),
    [
        ({"logprobs": True, "topLogprobs": 3}, True, None),
        ({"tokens": False}, False, None),
        ({"tokens": False}, True, None),
        ({"logprobs": True}, True, None),
        ({"tokens": False}, True, 50),
        ({"logprobs": True}, True, 50),
    ],
    ids=["alternatives", "messages", "text-steps", "token-steps", "text-steps-bounded", "token-steps-bounded"],
)
async def test_multiplex_sends_what_waits_together_message_for_message(
    fast_core, monkeypatch, output, steps, max_entries
):
    """The plain decode steps of a request started with `steps` (and without alternatives)
    travel as Steps entries with their token ids (and logprobs when asked), others as whole
    messages: what waits goes out as many of them in one message, in order with the request's
    events; `max_entries`: what waits fills several messages of at most that many events and
    entries (MAX_EVENTS_PER_MESSAGE), still in order."""
    if max_entries is not None:
        monkeypatch.setattr(multiplex, "MAX_EVENTS_PER_MESSAGE", max_entries)
    body = {
        "requestId": "m",
        "text": "Once upon a time",
        "stopping": {"maxNewTokens": TOKENS, "ignoreEos": True},
        "output": output,
    }
    runs = []
    for pause in (False, True):
        mux = Mux(fast_core.address, SMALL_WINDOW)
        if pause:
            mux.slow_until = asyncio.Event()
        mux.read()
        try:
            await mux.start((1, body), steps=frozenset({1} if steps else ()))
            if pause:
                await _stall(fast_core, PAUSE_S)
                mux.slow_until.set()
            await mux.ended_all(1)
            runs.append(mux)
        finally:
            await mux.close()
    prompt, slow = runs
    assert [m.state for m in slow.responses[1]] == [m.state for m in prompt.responses[1]]
    assert [(len(m.outputs), m.outputs[0].text if m.outputs else "") for m in slow.responses[1]] == [
        (len(m.outputs), m.outputs[0].text if m.outputs else "") for m in prompt.responses[1]
    ]
    assert _shape(slow.responses[1]) == _shape(prompt.responses[1])
    assert [m.HasField("usage") for m in slow.responses[1]] == [m.HasField("usage") for m in prompt.responses[1]]
    # Several engine steps of the request went out in one message while the reader paused.
    assert max(len(m.steps.ids) + sum(len(ev.responses) for ev in m.events) for m in slow.messages) > 10
    entries = sum(len(m.steps.ids) for m in slow.messages)
    as_steps = steps and "topLogprobs" not in output
    assert entries > TOKENS // 2 if as_steps else entries == 0
    asked = [lp for m in slow.messages for lp in m.steps.logprobs if not math.isnan(lp)]
    assert len(asked) == (entries if output.get("logprobs") else 0)
    if max_entries is not None:
        assert max(len(m.steps.ids) + len(m.events) for m in slow.messages) == max_entries


# --------------------------------------------------------------------------------- HTTP


async def _slow_post(core, port: int, path: str, body: dict, headers: dict[str, str]) -> list[bytes]:
    """POST with a small receive buffer, pause after the response headers, then read it all;
    returns the body's chunks (one per write of the gateway's ResponseWriter)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + data)
    status = await reader.readuntil(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and b"chunked" in status.lower(), status
    await _stall(core, LONG_PAUSE_S)
    raw = await reader.read()
    writer.close()
    chunks, at = [], 0
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end], 16)
        if size == 0:
            return chunks
        chunks.append(raw[end + 2 : end + 2 + size])
        at = end + 2 + size + 2


async def _post(port: int, path: str, body: dict, headers: dict[str, str]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers) as r:
        assert r.status == 200
        return await r.read()


def _records(raw: bytes, framing: str) -> list[Any]:
    if framing == "jsonlines":
        return [json.loads(line) for line in raw.splitlines() if line]
    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else _without_ids(json.loads(e)) for e in events]


def _without_ids(record: Any) -> Any:
    """OpenAI chunks carry a per-request id and creation time."""
    if isinstance(record, dict):
        return {k: v for k, v in record.items() if k not in ("id", "created")}
    return record


CASES = [
    (
        "lmi",
        "/invocations",
        {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": TOKENS, "ignore_eos_token": True}},
        {},
        "jsonlines",
    ),
    (
        "lmi",
        "/invocations",
        {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": TOKENS, "top_n_tokens": 2}},
        {"Accept": "text/event-stream"},
        "sse",
    ),
    (
        "openai",
        "/v1/chat/completions",
        {
            "model": "mock",
            "messages": [{"role": "user", "content": "Hello"}],
            "stream": True,
            "max_tokens": TOKENS,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
            "temperature": 0,
        },
        {},
        "sse",
    ),
    (
        "triton",
        "/v2/models/mock/generate_stream",
        {"text_input": "Hello", "parameters": {"max_tokens": TOKENS, "end_id": -1, "return_log_probs": True}},
        {},
        "sse",
    ),
]


async def test_http_streams_merge_writes_for_a_slow_reader_and_keep_every_record(fast_core, gateways):
    for name, path, body, headers, framing in CASES:
        prompt = _records(await _post(gateways[name], path, body, headers), framing)
        chunks = await _slow_post(fast_core, gateways[name], path, body, headers)
        slow = _records(b"".join(chunks), framing)
        assert slow == prompt, name
        # The records that waited for the slow reader went out merged, many to a write (chunk).
        assert len(chunks) < len(slow) // 2, (name, len(chunks), len(slow))
        records = [r for r in prompt if isinstance(r, dict) and {"token", "text_output", "choices"} & r.keys()]
        assert len(records) >= TOKENS, name  # one record per token, coalesced or not


# --------------------------------------------------------------------------------- WebSocket


async def _ws_events(core, port: int, request_id: str, pause: bool) -> tuple[list[dict], list[int]]:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    frames = []
    async with connect(f"ws://127.0.0.1:{port}/ws", sock=sock, max_queue=1, compression=None) as ws:
        frame = {
            "prompts": [{"request_id": request_id, "prompt": "Hello"}],
            "generation_config": {"max_new_tokens": TOKENS},
        }
        await ws.send(json.dumps(frame))
        if pause:
            await _stall(core, LONG_PAUSE_S)
        while True:
            frames.append(json.loads(await ws.recv()))
            if frames[-1][-1]["type"] in ("COMPLETE", "ERROR"):
                break
    events = [
        {k: v for k, v in e.items() if k not in ("request_id", "execution_time")} for frame in frames for e in frame
    ]
    return events, [len(frame) for frame in frames]


async def test_websocket_merges_events_into_arrays_for_a_slow_reader_and_keeps_every_event(fast_core, gateways):
    prompt, _ = await _ws_events(fast_core, gateways["ws"], "fast", pause=False)
    slow, frames = await _ws_events(fast_core, gateways["ws"], "slow", pause=True)
    assert slow == prompt
    assert sum(e["type"] == "PROGRESS" for e in slow) == TOKENS
    assert max(frames) > 10  # events that waited went out together, in one array
