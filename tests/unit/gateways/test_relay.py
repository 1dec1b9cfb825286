"""`relay` renders a CoreStream's deltas, whole messages and plain decode steps mixed, with the
one `render` of the route, in the order they arrived, writing each core message's bytes at once;
a render that fails ends the response in-band with the schema's error (`render_error`: the
GatewayError it raised, or INTERNAL for a bug) and never reaches the stream's reader; `finish`
is awaited after a complete stream and before its end (a GatewayError from it ends the response
in-band instead), never after an incomplete one; and a relayed call leaves no reference cycle
behind. A real aiohttp server on loopback relays a
CoreCall that the test feeds as the multiplexed stream's reader would (`_add_step`, `_add`,
`_end`, then `_notify` once per core message)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import grpc
import pytest
from aiohttp import web
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.config import GatewayConfig
from gateways.common.core_call import CoreCall, Delta, Step
from gateways.common.core_client import CONFIG_KEY
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, relay

CALLS = web.AppKey("calls", asyncio.Queue)
FINISHED = web.AppKey("finished", list)


def render(delta: Delta) -> bytes:
    if type(delta) is tuple:
        text, token_id, logprob = delta
        if text == "boom":
            raise RuntimeError("a rendering bug")
        if text == "refused":
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION, "refused by the schema")
        return f"S:{text}:{token_id}/{logprob}\n".encode()
    assert isinstance(delta, spb.GenerateResponse)
    text = "".join(o.text for o in delta.outputs)
    if text == "boom":
        raise RuntimeError("a rendering bug")
    tokens = "".join(f":{t.id}/{t.logprob if t.HasField('logprob') else None}" for o in delta.outputs for t in o.tokens)
    final = b"usage\n" if delta.HasField("usage") else b""
    return (f"M:{delta.request_id}:{text}{tokens}\n".encode() if delta.outputs else b"") + final


def render_error(err: GatewayError) -> bytes:
    return f"E:{err.code.name}:{err.message}\n".encode()


async def handler(request: web.Request) -> web.StreamResponse:
    call = CoreCall(spb.GenerateRequest(request_id="r1"), steps=True)
    call._news([spb.GenerateResponse(request_id="r1", state=pb.GENERATE_STATE_QUEUED)], False, None)
    await request.app[CALLS].put(call)
    return await relay(request, CoreStream(call), render, render_error, content_type="text/plain", end=lambda: b"END\n")


async def ended_handler(request: web.Request) -> web.StreamResponse:
    """A call whose whole stream (and end) arrived before the relay listened."""
    call = CoreCall(spb.GenerateRequest(request_id="r1"), steps=True)
    call._add_step(("a", 1, None))
    final = spb.GenerateResponse(request_id="r1")
    final.outputs.add().text = "all"
    final.usage.completion_tokens = 2
    call._news([final], True, None)
    return await relay(request, CoreStream(call), render, render_error, content_type="text/plain", end=lambda: b"END\n")


async def finish_handler(request: web.Request) -> web.StreamResponse:
    """Relays with `finish`: it records its call, then fails when the query asks for it."""
    call = CoreCall(spb.GenerateRequest(request_id="r1"), steps=True)
    await request.app[CALLS].put(call)

    async def finish() -> None:
        await asyncio.sleep(0)
        request.app[FINISHED].append("finished")
        if "fail" in request.query:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "store down")

    return await relay(
        request, CoreStream(call), render, render_error, content_type="text/plain", end=lambda: b"END\n", finish=finish
    )


@pytest.fixture
async def served():
    app = web.Application()
    app[CALLS] = asyncio.Queue()
    app[FINISHED] = []
    app.router.add_get("/", handler)
    app.router.add_get("/finish", finish_handler)
    app.router.add_get("/ended", ended_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            yield app, session, f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def core_message(call: CoreCall, *deltas: Step | spb.GenerateResponse, end: bool = False) -> None:
    """Hand `call` one core message's news, as the stream's reader does: its steps, its
    messages, its end when `end`, then one notify."""
    for delta in deltas:
        if isinstance(delta, tuple):
            call._add_step(delta)
        else:
            call._add([delta])
    if end:
        call._end(None)
    call._notify()


def message(text: str, *, final: bool = False) -> spb.GenerateResponse:
    msg = spb.GenerateResponse(request_id="r1", outputs=[pb.SequenceOutput(text=text)])
    if final:
        msg.usage.completion_tokens = 7
    return msg


async def _body(served, feed, path: str = "") -> bytes:
    app, session, url = served
    async with session.get(url + path) as resp:
        call = await app[CALLS].get()
        feed(call)
        return await resp.read()


async def test_steps_and_messages_render_in_order(served):
    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 5, -0.5))
        core_message(call, ("b", 6, None), ("", 7, None), ("c", 8, -1.0))  # several steps in one message
        core_message(call, ("d", 9, None), message("z"))
        core_message(call, message("y"), ("e", 10, -2.0))
        core_message(call, ("f", 11, None), message(".", final=True), end=True)

    body = await _body(served, feed)
    assert body == (
        b"S:a:5/-0.5\nS:b:6/None\nS::7/None\nS:c:8/-1.0\nS:d:9/None\nM:r1:z\nM:r1:y\nS:e:10/-2.0\n"
        b"S:f:11/None\nM:r1:.\nusage\nEND\n"
    )


@pytest.mark.parametrize("failing", ["step", "message"])
async def test_a_failing_render_ends_the_response_in_band(served, failing):
    """A rendering bug ends the response with INTERNAL after what rendered before it in the
    same core message; later news write nothing."""
    boom: Delta = ("boom", 2, None) if failing == "step" else message("boom")

    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 1, None), boom, ("lost", 3, None))
        core_message(call, ("after", 4, None), message("late"))

    body = await _body(served, feed)
    assert body == b"S:a:1/None\nE:INTERNAL:Internal error in the gateway.\n"


async def test_a_gateway_error_from_render_ends_the_response_with_it(served):
    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 1, None))
        core_message(call, ("refused", 2, None), ("b", 3, None))

    body = await _body(served, feed)
    assert body == b"S:a:1/None\nE:FAILED_PRECONDITION:refused by the schema\n"


@pytest.mark.parametrize("fails", [False, True])
async def test_finish_comes_after_a_complete_stream_and_before_its_end(served, fails):
    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 1, None))
        core_message(call, message(".", final=True), end=True)

    body = await _body(served, feed, "finish?fail" if fails else "finish")
    last = b"E:UNAVAILABLE:store down\n" if fails else b"END\n"
    assert body == b"S:a:1/None\nM:r1:.\nusage\n" + last
    assert served[0][FINISHED] == ["finished"]


async def test_an_incomplete_stream_is_not_finished(served):
    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 1, None), end=True)

    body = await _body(served, feed, "finish")
    assert body == b"S:a:1/None\nE:INTERNAL:The model server ended the response before it finished.\n"
    assert served[0][FINISHED] == []


async def test_a_stream_ending_without_its_final_message_ends_in_band(served):
    def feed(call: CoreCall) -> None:
        core_message(call, ("a", 1, None), end=True)

    body = await _body(served, feed)
    assert body == b"S:a:1/None\nE:INTERNAL:The model server ended the response before it finished.\n"


async def test_a_relayed_call_leaves_no_reference_cycle(served, collector_off):
    """Listening to a call that has ended (its whole stream came before the relay listened),
    or that ends while listened to, leaves no listener on it: its objects go with the handler,
    none waits for the cyclic garbage collector."""
    app, session, url = served
    async with session.get(url + "ended") as r:
        assert await r.read() == b"S:a:1/None\nM:r1:all\nusage\nEND\n"
    async with session.get(url) as r:
        call = await app[CALLS].get()
        final = spb.GenerateResponse(request_id="r1")
        final.usage.completion_tokens = 1
        core_message(call, ("b", 2, None), final, end=True)
        del call, final
        assert await r.read() == b"S:b:2/None\nusage\nEND\n"
    assert await collector_off(CoreCall) == []


@pytest.mark.parametrize(
    ("config", "pieces"),
    [
        (GatewayConfig(name="test", max_buffered_bytes=256 * 1024), 2000),  # at most 128 MiB offered
        (GatewayConfig(name="test", write_timeout=0.2), 64),  # 4 MiB, then nothing more
    ],
    ids=["max-buffered-bytes", "write-timeout"],
)
async def test_a_client_that_stops_reading_gets_its_request_cancelled(config, pieces):
    """Output for a client that reads nothing piles up only to --max-buffered-bytes, or waits
    only --write-timeout for it: then the relay cancels the request (the core aborts it) and
    aborts the connection."""
    app = web.Application()
    app[CONFIG_KEY] = config
    app[CALLS] = asyncio.Queue()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        call = await app[CALLS].get()
        # A CoreCall has no event to await for either state polled here.
        while call._listener is None:  # noqa: ASYNC110  # the relay listens once its response is prepared
            await asyncio.sleep(0)
        for _ in range(pieces):
            if call.ended:
                break
            core_message(call, ("x" * 65536, 1, None))
            await asyncio.sleep(0)
        async with asyncio.timeout(30):  # a guard: the write timeout ends it within 0.2 s
            while not call.ended:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert call.error is not None and call.error.code is grpc.StatusCode.CANCELLED
    finally:
        sock.close()
        await runner.cleanup()
