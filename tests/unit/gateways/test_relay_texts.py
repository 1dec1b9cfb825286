"""`relay` takes text-only messages (MultiplexEvent.texts) as strings, and compact tokens
(MultiplexEvent.token_ids) as their values, one entry alone (`CoreCall._entry_news`, the reader's
usual case) or several at once (`CoreCall._text_news`): each renders from those alone where the route's
render_text (render_token) can, else as the GenerateResponse it stands for, in order with the
other messages; a render_text that fails ends the response in-band, as a failing
message renderer does, and never the stream reader. A real aiohttp server on loopback relays a
CoreCall that the test feeds as the multiplexed stream's reader would."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import pytest
from aiohttp import web
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_client import CoreCall
from gateways.common.status import GatewayError
from gateways.common.streaming import CoreStream, relay

CALLS = web.AppKey("calls", asyncio.Queue)


def render(msg: spb.GenerateResponse) -> bytes:
    text = "".join(o.text for o in msg.outputs)
    tokens = "".join(f":{t.id}/{t.logprob if t.HasField('logprob') else None}" for o in msg.outputs for t in o.tokens)
    final = b"usage\n" if msg.HasField("usage") else b""
    return (f"M:{msg.request_id}:{text}{tokens}\n".encode() if msg.outputs else b"") + final


def render_text(text: str) -> bytes | None:
    if text == "boom":
        raise RuntimeError("a rendering bug")
    return None if text.startswith("raw") else f"T:{text}\n".encode()


def render_token(text: str, token_id: int, logprob: float | None) -> bytes | None:
    return None if text.startswith("raw") else f"K:{text}:{token_id}/{logprob}\n".encode()


def render_error(err: GatewayError) -> bytes:
    return f"E:{err.code.name}:{err.message}\n".encode()


async def handler(request: web.Request) -> web.StreamResponse:
    call = CoreCall(spb.GenerateRequest(request_id="r1"), lambda: None)
    call._news([spb.GenerateResponse(request_id="r1", state=pb.GENERATE_STATE_QUEUED)], False, None)
    await request.app[CALLS].put(call)
    return await relay(
        request,
        CoreStream(call),
        render,
        render_error,
        content_type="text/plain",
        end=lambda: b"END\n",
        render_text=render_text,
        render_token=render_token,
    )


async def ended_handler(request: web.Request) -> web.StreamResponse:
    """A call whose whole stream (and end) arrived before the relay listened."""
    call = CoreCall(spb.GenerateRequest(request_id="r1"), lambda: None)
    final = spb.GenerateResponse(request_id="r1")
    final.outputs.add().text = "all"
    final.usage.completion_tokens = 1
    call._news([final], True, None)
    return await relay(request, CoreStream(call), render, render_error, content_type="text/plain", end=lambda: b"END\n")


@pytest.fixture
async def served():
    app = web.Application()
    app[CALLS] = asyncio.Queue()
    app.router.add_get("/", handler)
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


@pytest.fixture(params=["lists", "entries"])
def texts(request):
    """How the reader hands a request its entries: always as lists, or one entry alone as values."""

    def give(call: CoreCall, texts: list[str], ids: Sequence[int] = (), lps: Sequence[float] = ()) -> None:
        if request.param == "entries" and len(texts) == 1:
            call._entry_news(texts[0], ids[0] if ids else None, lps[0] if lps else None)
        else:
            call._text_news(texts, ids, lps)

    return give


async def _body(served, feed) -> bytes:
    app, session, url = served
    async with session.get(url) as resp:
        call = await app[CALLS].get()
        feed(call)
        return await resp.read()


async def test_texts_render_in_order_with_the_messages(served, texts):
    def feed(call: CoreCall) -> None:
        texts(call, ["a"])
        texts(call, ["raw1"])  # render_text declines: rendered as the message it stands for
        texts(call, ["b", "raw2", "c"])
        call._news([spb.GenerateResponse(request_id="r1", outputs=[pb.SequenceOutput(text="z")])], False, None)
        texts(call, ["d"])
        final = spb.GenerateResponse(request_id="r1", outputs=[pb.SequenceOutput(text=".")])
        final.usage.completion_tokens = 7
        call._news([final], True, None)

    body = await _body(served, feed)
    assert body == b"T:a\nM:r1:raw1\nT:b\nM:r1:raw2\nT:c\nM:r1:z\nT:d\nM:r1:.\nusage\nEND\n"


async def test_compact_tokens_render_in_order_with_the_messages(served, texts):
    def feed(call: CoreCall) -> None:
        texts(call, ["a"], [5], [-0.5])
        texts(call, ["raw1"], [6], [-1.0])  # render_token declines: the message with its token
        texts(call, ["b", "", "c"], [7, 8, 9])  # no logprobs asked
        call._news([spb.GenerateResponse(request_id="r1", outputs=[pb.SequenceOutput(text="z")])], False, None)
        texts(call, ["d"], [10], [-2.0])
        final = spb.GenerateResponse(request_id="r1")
        final.usage.completion_tokens = 7
        call._news([final], True, None)

    body = await _body(served, feed)
    assert body == (
        b"K:a:5/-0.5\nM:r1:raw1:6/-1.0\nK:b:7/None\nK::8/None\nK:c:9/None\nM:r1:z\nK:d:10/-2.0\nusage\nEND\n"
    )


async def test_a_failing_text_render_ends_the_response_in_band(served, texts):
    def feed(call: CoreCall) -> None:
        texts(call, ["a"])
        texts(call, ["boom"])  # raises in render_text: must not reach the reader
        texts(call, ["after"])  # the response has ended: nothing more is written
        call._news([spb.GenerateResponse(request_id="r1", outputs=[pb.SequenceOutput(text="late")])], False, None)

    body = await _body(served, feed)
    assert body == b"T:a\nE:INTERNAL:Internal error in the gateway.\n"


async def test_texts_wait_behind_messages_not_yet_taken():
    """Without a text listener, or while messages wait to be taken, texts become the messages
    they stand for, in order (the request id is the core's, from its first message)."""
    call = CoreCall(spb.GenerateRequest(), lambda: None)
    call._news([spb.GenerateResponse(request_id="core-id", state=pb.GENERATE_STATE_QUEUED)], False, None)
    seen: list[tuple[list[str], list[int], list[float]]] = []
    call.listen_texts(lambda texts, ids, lps: seen.append((list(texts), list(ids), list(lps))))
    call._text_news(["x", "y"])
    call._text_news(["t"], [4], [-0.25])
    assert seen == []  # the QUEUED message waits: the texts queue behind it
    msgs = call.take()
    assert [m.state for m in msgs] == [pb.GENERATE_STATE_QUEUED, 0, 0, 0]
    assert [(m.request_id, [o.text for o in m.outputs]) for m in msgs[1:]] == [
        ("core-id", ["x"]),
        ("core-id", ["y"]),
        ("core-id", ["t"]),
    ]
    assert [len(m.outputs[0].tokens) for m in msgs[1:]] == [0, 0, 1]
    token = msgs[3].outputs[0].tokens[0]
    assert (token.id, token.logprob, token.text, token.bytes, token.special) == (4, -0.25, "", b"", False)
    call._text_news(["w"])
    call._text_news(["v"], [3])
    assert seen == [(["w"], [], []), (["v"], [3], [])]


async def test_entries_wait_behind_messages_not_yet_taken():
    """An entry listener takes an entry only once the messages before it were taken; until then
    entries become the messages they stand for, in order."""
    call = CoreCall(spb.GenerateRequest(), lambda: None)
    call._news([spb.GenerateResponse(request_id="core-id", state=pb.GENERATE_STATE_QUEUED)], False, None)
    entries: list[tuple[str, int | None, float | None]] = []
    call.listen_texts(lambda texts, ids, lps: None, lambda text, tok, lp: entries.append((text, tok, lp)))
    call._entry_news("x", None, None)
    call._entry_news("t", 4, -0.25)
    assert entries == []
    msgs = call.take()
    assert [[o.text for o in m.outputs] for m in msgs] == [[], ["x"], ["t"]]
    assert [[(t.id, t.logprob) for t in m.outputs[0].tokens] for m in msgs[1:]] == [[], [(4, -0.25)]]
    call._entry_news("w", 3, None)
    assert entries == [("w", 3, None)]


async def test_a_relayed_call_leaves_no_reference_cycle(served, collector_off):
    """Listening to a call that has ended (its whole stream came before the relay listened),
    or that ends while listened to, leaves no listener on it: its objects go with the handler,
    none waits for the cyclic garbage collector."""
    app, session, url = served
    async with session.get(url + "ended") as r:
        assert await r.read() == b"M:r1:all\nusage\nEND\n"
    async with session.get(url) as r:
        call = await app[CALLS].get()
        final = spb.GenerateResponse(request_id="r1")
        final.usage.completion_tokens = 0
        call._news([final], True, None)
        del call, final
        assert await r.read() == b"usage\nEND\n"
    assert await collector_off(CoreCall) == []
