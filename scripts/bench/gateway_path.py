#!/usr/bin/env python
"""The gateway's own Python per streamed token, without sockets or a core: CPU µs per token of
the path from a MultiplexGenerate message to the bytes handed to each response's transport.

A fake MultiplexGenerate call hands the real stream reader (`multiplexed.MultiplexedStream`)
pre-serialized core messages, parsed as grpc would (`FromString`): one message per engine step
carrying one event per stream, the first with QUEUED, SCHEDULED and the first token as
responses, then one plain decode step per engine step (a Steps entry, as the core sends it to
a request started with `steps`; or `--form responses`: the GenerateResponse each stands for),
then the final message and the OK status.
Each stream is relayed by the real `streaming._relay_pushed` with the route's real renderer
(OpenAI chat SSE, Triton SSE, LMI jsonlines) into a transport that only counts bytes. What this
leaves out is what the overhead benchmark (overhead.py) adds: HTTP parsing, gRPC, the event
loop's I/O and the send system calls.

Usage: python scripts/bench/gateway_path.py [--streams 256] [--tokens 64] [--rounds 5] [--schemas openai,triton,lmi]
       [--form steps|responses]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from aiohttp.http_writer import StreamWriter
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import route as chat_route
from gateways.common.chat import translate as chat
from gateways.common.chat.schema import parse_chat_request
from gateways.common.core_call import CoreCall
from gateways.common.core_client import CoreClient
from gateways.common.framing import jsonline
from gateways.common.multiplexed import MultiplexedStream
from gateways.common.streaming import CoreStream, _relay_pushed
from gateways.common.writer import ResponseWriter
from gateways.lmi.routes import record_renderer
from gateways.lmi.translate import RenderOptions, StreamRenderer
from gateways.triton.routes import event_renderer
from gateways.triton.translate import ResponseRenderer


class _Transport:
    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)

    def is_closing(self) -> bool:
        return False


class _Protocol:
    writing_paused = False

    def __init__(self) -> None:
        self.transport = _Transport()


class _Request(dict):
    """What ResponseWriter reads of an aiohttp request: its protocol and chunked writer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.protocol = _Protocol()
        self.writer = StreamWriter(self.protocol, loop)  # type: ignore[arg-type]
        self.writer.enable_chunking()


class _Call:
    """A MultiplexGenerate call that reads the given serialized messages, then EOF."""

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = iter(messages)

    async def read(self) -> Any:
        import grpc

        await asyncio.sleep(0)  # as a real read, let the relays run between messages
        raw = next(self.messages, None)
        return grpc.aio.EOF if raw is None else spb.MultiplexGenerateResponse.FromString(raw)

    async def write(self, msg: Any) -> None:
        pass

    async def done_writing(self) -> None:
        pass


class _Stub:
    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages

    def MultiplexGenerate(self, metadata: Any = None) -> _Call:
        return _Call(self.messages)


def core_messages(streams: int, tokens: int, form: str, with_tokens: bool) -> list[bytes]:
    """The serialized messages of `streams` requests of `tokens` tokens each, one per step, the
    middle steps in `form` (see the module docstring); `with_tokens`: each with its token's id
    and logprob (as LMI asks for them)."""

    def rid(i: int) -> str:
        return f"chatcmpl-{i:032x}"

    def output(msg: spb.GenerateResponse, text: str, **fields: Any) -> None:
        out = msg.outputs.add(text=text, **fields)
        if with_tokens:
            out.tokens.add(id=100, text=text, bytes=text.encode(), logprob=-0.5)

    out: list[bytes] = []
    first = spb.MultiplexGenerateResponse()
    for i in range(streams):
        ev = first.events.add(id=i + 1)
        ev.responses.add(request_id=rid(i), state=pb.GENERATE_STATE_QUEUED)
        ev.responses.add(request_id=rid(i), state=pb.GENERATE_STATE_SCHEDULED)
        output(ev.responses.add(request_id=rid(i), state=pb.GENERATE_STATE_GENERATING), "Once")
    out.append(first.SerializeToString())
    for step in range(tokens - 2):
        msg = spb.MultiplexGenerateResponse()
        for i in range(streams):
            if form == "steps":
                msg.steps.ids.append(i + 1)
                msg.steps.texts.append(f" word{step}")
                msg.steps.token_ids.append(100 + step)
                msg.steps.logprobs.append(-0.5 if with_tokens else float("nan"))
                continue
            output(msg.events.add(id=i + 1).responses.add(request_id=rid(i)), f" word{step}")
        out.append(msg.SerializeToString())
    last = spb.MultiplexGenerateResponse()
    for i in range(streams):
        ev = last.events.add(id=i + 1)
        final = ev.responses.add(request_id=rid(i))
        output(final, " end", finish_reason=pb.FINISH_REASON_LENGTH)
        final.usage.prompt_tokens, final.usage.completion_tokens = 5, tokens
        ev.status.SetInParent()
    out.append(last.SerializeToString())
    return out


def _renderer(schema: str) -> tuple[Any, Any]:
    """(render, end) of one stream of `schema`, as its route makes them."""
    if schema == "openai":
        req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        state = chat.state_for(req, completion_id="chatcmpl-1", created=5, model="demo")
        return chat_route.chunk_renderer(state, "sse"), lambda: chat_route.end_of_stream("sse")
    if schema == "lmi":
        return record_renderer(StreamRenderer(RenderOptions(inputs="hi", stream=True)), jsonline), None
    return event_renderer(ResponseRenderer("demo", "1", client_id=None, logprobs=False)), None


async def one_round(schema: str, streams: int, tokens: int, form: str) -> float:
    """CPU µs per token of relaying `streams` x `tokens` tokens (see the module docstring)."""
    loop = asyncio.get_running_loop()
    messages = core_messages(streams, tokens, form, with_tokens=schema == "lmi")
    client = CoreClient("127.0.0.1:1")
    t0 = time.process_time()
    mux = MultiplexedStream(client, _Stub(messages))  # its reader starts at the next await
    relays = []
    for i in range(streams):
        call = CoreCall(spb.GenerateRequest(request_id=f"chatcmpl-{i:032x}"), steps=form == "steps")
        mux.open[i + 1] = call
        render, end = _renderer(schema)
        out = ResponseWriter(_Request(loop))  # type: ignore[arg-type]
        relay = _relay_pushed(CoreStream(call), out, render, lambda e: b"", end)
        relays.append(asyncio.create_task(relay))
    await asyncio.gather(*relays)
    cpu = time.process_time() - t0
    await client.close()
    return 1e6 * cpu / (streams * tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--schemas", default="openai,triton,lmi")
    p.add_argument("--form", choices=("steps", "responses"), default="steps", help="how middle steps travel")
    args = p.parse_args()
    for schema in args.schemas.split(","):
        runs = [asyncio.run(one_round(schema, args.streams, args.tokens, args.form)) for _ in range(args.rounds)]
        print(
            f"{schema:<7} {args.form:<9} {args.streams} streams x {args.tokens} tokens: CPU µs per token "
            f"median {statistics.median(runs):.2f} (min {min(runs):.2f}, max {max(runs):.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
