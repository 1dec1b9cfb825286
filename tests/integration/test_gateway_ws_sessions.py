"""Continue generation through the ws gateway: request_id is the core's session key.

Greedy continuation in two halves equals one call of the whole length (through the gateway, and
token for token over gRPC); a session that ended on EOS starts fresh; the token bound of the
session store evicts the least recently used session; a generation cut short by closing the
socket keeps what it generated.
"""

from __future__ import annotations

import asyncio
import json

import pytest_asyncio
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from websockets.asyncio.client import connect

from core.server import start_core
from tests.conftest import core_config
from tests.integration.core_helpers import wait_idle
from tests.integration.test_gateway_ws import LONG, WAIT, batch, check_lifecycle, greedy, recv, run, ws_url

EOS = 2
# Greedy on the tiny model changes its repeated token within the first 16 new tokens, so a
# continuation that lost or repeated a token would not match the single call.
PROMPT = "The cat sat on"


@pytest_asyncio.fixture(scope="module")
async def gateway(start_gateway) -> str:
    return await start_gateway("ws", env_file="")


async def test_two_continued_calls_equal_one_call(gateway):
    async with connect(ws_url(gateway)) as ws:
        first = await run(ws, batch(("cont-1", PROMPT), **greedy(8)))
        second = await run(ws, batch(("cont-1", "this prompt is ignored"), only_new_tokens=False, **greedy(8)))
        whole = await run(ws, batch(("cont-whole", PROMPT), **greedy(16)))
    a = check_lifecycle(first["cont-1"], max_new_tokens=8)
    b = check_lifecycle(second["cont-1"], max_new_tokens=8)
    w = check_lifecycle(whole["cont-whole"], max_new_tokens=16)
    # only_new_tokens false on a continued session: INITIALIZED is everything so far, COMPLETE
    # the whole sequence; only_new_tokens true: just this call's text.
    assert second["cont-1"][2]["text"] == PROMPT + a["text"]
    second_new = "".join(e["text"] for e in second["cont-1"][3:-1])
    assert b["text"] == PROMPT + a["text"] + second_new
    assert a["text"] + second_new == w["text"]


async def test_continued_tokens_match_over_grpc(stub):
    """Token for token: two continued calls of 8 are the single call of 16."""

    async def tokens(session_id: str, n: int, text: str = PROMPT) -> tuple[list[int], bool]:
        req = spb.GenerateRequest(
            text=text,
            session_id=session_id,
            sampling=pb.SamplingParams(do_sample=False),
            stopping=pb.StoppingParams(max_new_tokens=n),
            output=pb.OutputOptions(logprobs=True),
        )
        msgs = [m async for m in stub.Generate(req)]
        return [t.id for m in msgs for o in m.outputs for t in o.tokens], msgs[0].session_continued

    half1, continued1 = await tokens("grpc-cont", 8)
    half2, continued2 = await tokens("grpc-cont", 8, text="ignored")
    whole, _ = await tokens("grpc-whole", 16)
    assert (continued1, continued2) == (False, True)
    assert half1 + half2 == whole
    assert len(set(whole)) > 1


async def test_session_that_ended_on_eos_starts_fresh(gateway, stub):
    async with connect(ws_url(gateway)) as ws:
        await run(ws, batch(("eos-1", PROMPT), **greedy(4)))
        # The ws protocol cannot force EOS; continue the same session over gRPC with a bias on EOS.
        req = spb.GenerateRequest(
            session_id="eos-1",
            sampling=pb.SamplingParams(do_sample=False, logit_bias={EOS: 100.0}),
            stopping=pb.StoppingParams(max_new_tokens=4),
        )
        msgs = [m async for m in stub.Generate(req)]
        assert msgs[0].session_continued
        assert msgs[-1].outputs[-1].finish_reason == pb.FINISH_REASON_EOS
        fresh = await run(ws, batch(("eos-1", "Once upon a time"), only_new_tokens=False, **greedy(4)))
    events = fresh["eos-1"]
    check_lifecycle(events, max_new_tokens=4)
    assert events[2]["text"] == "Once upon a time"  # the new prompt, not the ended sequence
    assert events[-1]["text"].startswith("Once upon a time")


async def test_token_bound_evicts_the_least_recently_used_session(tiny_model_dir, stub, start_gateway):
    prompts = {"evict-a": "Hello world", "evict-b": "The cat sat on", "evict-c": "Once upon a time"}
    new = 8
    sizes = {}
    for rid, text in prompts.items():
        ids = (await stub.Tokenize(spb.TokenizeRequest(text=text))).token_ids
        sizes[rid] = len(ids) + new
    # Room for b and c (and b's growth by `new`), not for all three: storing c evicts a.
    bound = sum(sizes.values()) - 1
    core = await start_core(core_config(tiny_model_dir, session_max_tokens=bound, engine_process=False))
    try:
        url = await start_gateway("ws", env_file="", core=core.address)
        async with connect(ws_url(url)) as ws:
            first = {}
            for rid, text in prompts.items():
                first[rid] = (await run(ws, batch((rid, text), **greedy(new))))[rid][-1]["text"]
            again_b = await run(ws, batch(("evict-b", ""), only_new_tokens=False, **greedy(new)))
            again_a = await run(ws, batch(("evict-a", "Hello world"), only_new_tokens=False, **greedy(new)))
        assert again_b["evict-b"][2]["text"] == prompts["evict-b"] + first["evict-b"]  # continued
        assert again_a["evict-a"][2]["text"] == prompts["evict-a"]  # evicted: started fresh
        assert again_a["evict-a"][-1]["text"] == prompts["evict-a"] + first["evict-a"]  # greedy: same text again
    finally:
        await core.stop(0)


async def test_generation_cut_short_by_closing_the_socket_can_be_continued(gateway, core):
    async with connect(ws_url(gateway)) as ws:
        await ws.send(json.dumps(batch(("cut-1", PROMPT), **greedy(LONG))))
        streamed = ""
        while len(streamed) < 20:
            streamed += "".join(e["text"] for e in await recv(ws) if e["type"] == "PROGRESS")
    await wait_idle(core.engine)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    async with connect(ws_url(gateway)) as ws:
        while True:  # the core releases the session right after it aborts the request
            events = (await run(ws, batch(("cut-1", ""), only_new_tokens=False, **greedy(2))))["cut-1"]
            if events[-1]["type"] != "ERROR" or "already generating" not in events[-1]["error"]:
                break
            assert loop.time() < deadline, events
            await asyncio.sleep(0.05)
    check_lifecycle(events, max_new_tokens=2)
    assert events[2]["text"].startswith(PROMPT + streamed)  # everything generated before the close
