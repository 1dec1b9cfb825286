"""MultiplexGenerate, the gateways' RPC: many requests on one stream, each with exactly the
messages and end status Generate would give it (generate_service.proto).

A raw client of the RPC drives a real core on the mock engine over loopback; the last test kills
a core process under every gateway and checks that each open request gets its schema's in-band
error, and a new one the error status.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal

import aiohttp
import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from core.server import start_core
from core.types import EngineOutput, EngineRequest, FinishReason, SequenceStep
from gateways.common.status import GatewayError
from tests.conftest import core_config
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.core_helpers import generate, request, sequences, start_core_process, wait_for, wait_idle


def step_entries(msg: spb.MultiplexGenerateResponse) -> list[tuple]:
    """A message's Steps entries as (id, text, token id, logprob), the logprob None for NaN."""
    steps = msg.steps
    columns = zip(steps.ids, steps.texts, steps.token_ids, steps.logprobs, strict=True)
    return [(rid, text, tok, None if math.isnan(lp) else lp) for rid, text, tok, lp in columns]


def step_response(
    request_id: str, text: str, token_id: int, logprob: float | None, tokens: bool
) -> spb.GenerateResponse:
    """The GenerateResponse a Steps entry stands for (generate_service.proto, Steps): without
    its token for a request with OutputOptions.tokens false."""
    response = spb.GenerateResponse(request_id=request_id)
    out = response.outputs.add(index=0, text=text)
    if tokens:
        tok = out.tokens.add(id=token_id)
        if logprob is not None:
            tok.logprob = logprob
    return response


class Mux:
    """A MultiplexGenerate client that records every event per id."""

    def __init__(self, address: str, options: list[tuple[str, int]] | None = None):
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self.call = spb_grpc.GenerateServiceStub(self.channel).MultiplexGenerate()
        self.responses: dict[int, list[spb.GenerateResponse]] = {}
        self.tokens_false: set[int] = set()
        self.status: dict[int, spb.Status] = {}
        self.messages: list[spb.MultiplexGenerateResponse] = []
        self.ended: grpc.aio.EOF | grpc.RpcError | None = None
        self.reader: asyncio.Task[None] | None = None
        self.slow_until: asyncio.Event | None = None

    def read(self) -> None:
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    self.ended = msg
                    return
                self.messages.append(msg)
                # A request's steps come before its events in a message; the first message of
                # a request (an event) carries its id.
                for rid, text, tok, lp in step_entries(msg):
                    got = self.responses[rid]
                    got.append(step_response(got[0].request_id, text, tok, lp, rid not in self.tokens_false))
                for ev in msg.events:
                    got = self.responses.setdefault(ev.id, [])
                    got += ev.responses
                    if ev.HasField("status"):
                        self.status[ev.id] = ev.status
                if self.slow_until is not None:
                    await self.slow_until.wait()
        except grpc.RpcError as e:
            self.ended = e

    async def start(self, *bodies: tuple[int, dict], steps: frozenset[int] = frozenset()) -> None:
        self.tokens_false |= {rid for rid, body in bodies if body.get("output", {}).get("tokens") is False}
        starts = [spb.MultiplexStart(id=rid, request=request(body), steps=rid in steps) for rid, body in bodies]
        await self.call.write(spb.MultiplexGenerateRequest(starts=starts))

    async def cancel(self, *ids: int) -> None:
        await self.call.write(spb.MultiplexGenerateRequest(cancels=ids))

    async def ended_all(self, *ids: int) -> None:
        await wait_for(lambda: all(i in self.status for i in ids))

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        await self.channel.close()


def _body(i: int, **extra) -> dict:
    body = {
        "requestId": f"r{i}",
        "text": f"prompt number {i} " * (1 + i % 3),
        "stopping": {"maxNewTokens": 4 + i % 9, "ignoreEos": True},
    }
    body.update(extra)
    return body


def _shape(msgs: list[spb.GenerateResponse]) -> tuple:
    """What a client reads from a stream: states in order, per-sequence text, tokens, logprobs
    and finish, and usage."""
    states = [m.state for m in msgs if m.state]
    seqs = {
        i: (s["text"], s["ids"], [t.logprob for t in s["tokens"]], s["finish"], s.get("cumulative"))
        for i, s in sequences(msgs).items()
    }
    return states, seqs, msgs[-1].usage.completion_tokens, msgs[-1].HasField("usage")


async def test_many_requests_get_what_generate_gives_them(start_mock_core):
    core = await start_mock_core(mock_step_ms=2.0)
    outputs = {0: {"logprobs": True, "topLogprobs": 2}, 2: {"tokens": False}, 3: {"logprobs": True}}  # by i % 4
    bodies = [(i, _body(i, output=outputs.get(i % 4, {}))) for i in range(1, 41)]
    bodies += [(99, _body(99, sampling={"n": 2, "seed": 5, "doSample": True}, output={"logprobs": True}))]
    steps = frozenset(i for i in range(1, 41) if i % 8 >= 4) | {99}
    mux = Mux(core.address)
    mux.read()
    try:
        await mux.start(*bodies[:20], steps=steps)
        await mux.start(*bodies[20:], steps=steps)
        await mux.ended_all(*(rid for rid, _ in bodies))
        stub = spb_grpc.GenerateServiceStub(mux.channel)
        for rid, body in bodies:
            got = mux.responses[rid]
            assert mux.status[rid].code == 0, mux.status[rid]
            assert got[0].state == pb.GENERATE_STATE_QUEUED
            assert all(m.request_id == body["requestId"] for m in got)
            assert _shape(got) == _shape(await generate(stub, body))
        # The plain decode steps of requests started with `steps` travel as Steps entries
        # (with their token, and their logprob when asked); requests with alternatives, with
        # several sequences or started without `steps` never do.
        entries = [e for m in mux.messages for e in step_entries(m)]
        assert {e[0] for e in entries} == {rid for rid in steps if rid % 4 != 0 and rid != 99}
        for rid, _, _, lp in entries:
            assert (lp is not None) == (rid % 4 == 3)  # logprobs asked by i % 4 == 3
        # No step of a request follows an event of it in the same message.
        for m in mux.messages:
            assert not {e[0] for e in step_entries(m)} & {
                ev.id for ev in m.events if ev.responses[:-1] or ev.status.code
            }
        # Events of several requests travel together: one message per engine step, not per token.
        assert any(len({ev.id for ev in m.events} | set(m.steps.ids)) > 10 for m in mux.messages)
        assert len(mux.messages) < sum(len(r) for r in mux.responses.values()) / 5
    finally:
        await mux.close()


async def test_steps_carry_generates_tokens(tiny_model_dir, tokenizer):
    """A request started with `steps` gets Generate's text, token ids, logprobs and finish, one
    message per engine step; a special token, a step of two tokens and a step without a
    logprob travel whole, and a byte token that completes no character travels with empty
    text."""
    ids = tokenizer.encode("Hi 中文 there", add_special_tokens=False)
    special = min(tokenizer.special_ids - tokenizer.eos_token_ids)
    steps = [[i] for i in ids[:4]] + [[special]] + [[i] for i in ids[4:-3]] + [ids[-3:-1], [ids[-1]]]

    def script(req: EngineRequest) -> list[EngineOutput]:
        outs = [
            EngineOutput(req.request_id, sequences=[SequenceStep(0, t, logprobs=[-0.25 * (k + 1)] * len(t))])
            for k, t in enumerate(steps)
        ]
        outs[2].sequences[0].logprobs = [None]  # an engine that could not learn this one
        outs[-1].sequences[0].finish_reason = FinishReason.LENGTH
        outs[-1].finished = True
        return outs

    server = await start_core(
        core_config(tiny_model_dir), engine=ScriptedEngine(tokenizer.vocab_size, script), tokenizer=tokenizer
    )
    mux = Mux(server.address)
    mux.read()
    try:
        body = {"requestId": "c", "text": "hello", "output": {"logprobs": True}}
        await mux.start((1, body), steps=frozenset({1}))
        await mux.ended_all(1)
        assert mux.status[1].code == 0
        whole = await generate(spb_grpc.GenerateServiceStub(mux.channel), body)
        assert _shape(mux.responses[1]) == _shape(whole)
        assert len([m for m in mux.responses[1] if m.outputs]) == len(steps)
        entries = [(t, i) for m in mux.messages for _, t, i, _ in step_entries(m)]
        assert len(entries) == len(steps) - 5  # the first step, the special, no logprob, two tokens, the last
        assert "" in [t for t, _ in entries]
        sent_whole = [
            t for m in mux.messages for ev in m.events for r in ev.responses for o in r.outputs for t in o.tokens
        ]
        assert [t.id for t in sent_whole if t.special] == [special]
        assert all(t.text and t.bytes for t in sent_whole)  # whole tokens keep their text and bytes
    finally:
        await mux.close()
        await server.stop(0)


async def test_errors_before_the_first_message_are_generates_statuses(start_mock_core, mock_core):
    full = await start_mock_core(max_queue_size=0)
    draining = await start_mock_core()
    draining.servicer.drain()
    cases = [
        (mock_core, {"text": "x", "sampling": {"topP": 0}}, grpc.StatusCode.INVALID_ARGUMENT),
        (mock_core, {"text": "x", "output": {"topLogprobs": 2}}, grpc.StatusCode.INVALID_ARGUMENT),
        (mock_core, {"text": "x", "output": {"logprobs": True, "tokens": False}}, grpc.StatusCode.INVALID_ARGUMENT),
        (mock_core, {"text": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
        (full, {"text": "x"}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (draining, {"text": "x"}, grpc.StatusCode.UNAVAILABLE),
    ]
    for server, body, code in cases:
        mux = Mux(server.address)
        mux.read()
        try:
            await mux.start((7, body))
            await mux.ended_all(7)
            assert mux.responses[7] == []
            st = mux.status[7]
            got = GatewayError.from_status(st.code, st.message, st.details)
            with pytest.raises(grpc.RpcError) as info:
                await generate(spb_grpc.GenerateServiceStub(mux.channel), body)
            want = GatewayError.from_rpc_error(info.value)
            assert (got.code, got.message, got.param, got.reason) == (code, want.message, want.param, want.reason)
        finally:
            await mux.close()


async def test_an_open_id_cannot_be_started_twice(mock_core):
    mux = Mux(mock_core.address)
    mux.read()
    try:
        await mux.start((1, _body(1, stopping={"maxNewTokens": 50})))
        await wait_for(lambda: 1 in mux.responses)
        await mux.start((1, _body(2)))
        await wait_for(lambda: 1 in mux.status)
        assert mux.status[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    finally:
        await mux.close()


async def test_cancel_aborts_the_engine_request_and_the_stream_goes_on(start_mock_core):
    core = await start_mock_core(mock_step_ms=5.0)
    mux = Mux(core.address)
    mux.read()
    try:
        await mux.start((1, _body(1, stopping={"maxNewTokens": 900, "ignoreEos": True})))
        await wait_for(lambda: any(m.outputs for m in mux.responses.get(1, [])))
        await mux.cancel(1, 12345)  # an unknown id is ignored
        await wait_idle(core.engine)
        await mux.start((2, _body(2)))
        await mux.ended_all(2)
        assert mux.status[2].code == 0 and 1 not in mux.status
    finally:
        await mux.close()


async def test_draining_refuses_new_starts_finishes_open_ones_then_ends_the_stream(start_mock_core):
    core = await start_mock_core(mock_step_ms=5.0)
    mux = Mux(core.address)
    mux.read()
    try:
        await mux.start(*[(i, _body(i, stopping={"maxNewTokens": 40, "ignoreEos": True})) for i in (1, 2, 3)])
        await wait_for(lambda: all(i in mux.responses for i in (1, 2, 3)))
        stopping = asyncio.create_task(core.stop(grace=30))
        await wait_for(lambda: core.servicer.draining)
        await mux.start((4, _body(4)))
        await mux.ended_all(1, 2, 3, 4)
        assert mux.status[4].code == grpc.StatusCode.UNAVAILABLE.value[0] and mux.responses[4] == []
        assert all(mux.status[i].code == 0 for i in (1, 2, 3))
        assert all(sequences(mux.responses[i])[0]["finish"] == pb.FINISH_REASON_LENGTH for i in (1, 2, 3))
        await asyncio.wait_for(stopping, 10)  # the stream ended once idle: no wait for the grace
        await wait_for(lambda: mux.ended is not None)
        assert mux.ended is grpc.aio.EOF
    finally:
        await mux.close()


# ----------------------------------------------------------------------------- a core killed


async def _lmi(session, url, out):
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos_token": True}}
    async with session.post(url + "/invocations", json=body) as r:
        async for line in r.content:
            out.append(json.loads(line))


async def _sse(session, url, path, body, out):
    async with session.post(url + path, json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                out.append(line[6:].strip().decode())


async def _ws(url, out):
    async with connect(url.replace("http", "ws") + "/ws") as ws:
        frame = {"prompts": [{"request_id": "k1", "prompt": "Hello"}], "generation_config": {"max_new_tokens": 2000}}
        await ws.send(json.dumps(frame))
        while True:
            for event in json.loads(await ws.recv()):
                out.append(event)
                if event["type"] in ("COMPLETE", "ERROR"):
                    return


async def test_a_killed_core_fails_every_open_request_in_its_schema(start_gateway, tokenizer_only_dir):
    proc, address = await start_core_process(
        *("--engine", "mock", "--model", str(tokenizer_only_dir), "--port", "0", "--model-name", "tiny"),
        *("--mock-step-ms", "20", "--mock-context-length", "8192", "--log-level", "WARNING"),
    )
    try:
        urls = {}
        for name in ("lmi", "openai", "triton", "ws"):
            urls[name] = await start_gateway(name, core=address, **({"env_file": ""} if name == "ws" else {}))
        outs: dict[str, list] = {name: [] for name in ("lmi", "openai", "triton", "ws")}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2000}
        chat["ignore_eos"] = True
        triton = {"text_input": "Hello", "parameters": {"max_tokens": 2000, "end_id": -1}}
        async with aiohttp.ClientSession() as session:
            tasks = [
                asyncio.create_task(_lmi(session, urls["lmi"], outs["lmi"])),
                asyncio.create_task(_sse(session, urls["openai"], "/v1/chat/completions", chat, outs["openai"])),
                asyncio.create_task(
                    _sse(session, urls["triton"], "/v2/models/tiny/generate_stream", triton, outs["triton"])
                ),
                asyncio.create_task(_ws(urls["ws"], outs["ws"])),
            ]
            await wait_for(lambda: all(len(o) >= 3 for o in outs.values()))
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            # Started streams end with the schema's in-band error.
            last = outs["lmi"][-1]
            assert last["token"]["id"] == -1 and last["details"]["finish_reason"] == "error" and last["error"]
            assert outs["openai"][-1] == "[DONE]" and "error" in json.loads(outs["openai"][-2])
            assert "error" in json.loads(outs["triton"][-1])
            assert outs["ws"][-1]["type"] == "ERROR" and outs["ws"][-1]["request_id"] == "k1"
            # A new request fails before its first byte, with the error status.
            async with session.post(urls["openai"] + "/v1/chat/completions", json=chat) as r:
                assert r.status == 503 and "error" in await r.json()
            async with session.post(urls["lmi"] + "/invocations", json={"inputs": "x", "stream": True}) as r:
                assert r.status == 503
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
