"""Closed-loop load generator for Trellis and OpenAI-compatible servers.

`concurrency` workers each send one streaming request at a time, from a fixed prompt set, with a
fixed max_new_tokens and EOS ignored where the protocol allows, until `requests` have finished
(after `warmup` unmeasured ones). Per request it records TTFT (request sent -> first token),
ITL (gaps between token-carrying messages), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E latency;
overall, output tokens/s and requests/s over the measured window. Every client runs in this
process on asyncio, so the client's own cost is the same for every target.

Targets:
  grpc        trellis core, GenerateService/Generate (text prompt, or chat messages with --chat)
  mux         trellis core, every request on one MultiplexGenerate stream (what a gateway does)
  openai      POST /v1/chat/completions with stream=true (Trellis gateway or any OpenAI server)
  lmi         POST /invocations, jsonlines streaming (Trellis LMI gateway)
  triton      POST /v2/models/<model>/generate_stream (Trellis Triton gateway)
  ws          /ws batch protocol, one prompt per frame, one socket per stream (Trellis ws gateway)

A `Meter` attached to a client (scripts/bench/overhead.py) also counts what arrives across all
requests inside a measurement window: tokens, ITL gaps, TTFT and TPOT.

Usage:
  python scripts/bench/loadgen.py grpc --address 127.0.0.1:50051 --concurrency 16 --requests 64
  python scripts/bench/loadgen.py openai --url http://127.0.0.1:8000 --model demo --concurrency 16
Writes a JSON result with --output and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_CONTENT = re.compile(rb'"content":\s*"(?!")')

PROMPTS = [
    "def __init__(self, config):",
    "The GNU General Public License is a free, copyleft license for",
    "import os\nimport sys\n\n",
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "class Parser:\n    def parse(self, text):",
    'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND',
    "for line in open(path):",
    "This program is distributed in the hope that it will be useful,",
]


@dataclass
class Sample:
    """Timings of one request, in seconds."""

    ttft: float
    e2e: float
    tokens: int
    itl: list[float] = field(default_factory=list)


@dataclass
class Result:
    """Aggregate figures of one run."""

    target: str
    concurrency: int
    requests: int
    max_new_tokens: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: int

    def row(self) -> str:
        return (
            f"{self.target:<22} c={self.concurrency:<3} {self.output_tokens_per_s:8.0f} tok/s "
            f"{self.requests_per_s:6.2f} req/s  TTFT p50 {self.ttft_ms['p50']:7.1f} p99 {self.ttft_ms['p99']:7.1f}  "
            f"ITL p50 {self.itl_ms['p50']:6.2f} p99 {self.itl_ms['p99']:6.2f}  "
            f"TPOT p50 {self.tpot_ms['p50']:6.2f}  E2E p50 {self.e2e_ms['p50']:7.1f} ms  errors {self.errors}"
        )


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    s = sorted(values)
    return {
        "p50": 1000 * s[len(s) // 2],
        "p99": 1000 * s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
        "mean": 1000 * statistics.fmean(s),
    }


class Meter:
    """What arrives across every request of a run while `on` (a measurement window): tokens,
    token-carrying messages, ITL gaps and TTFTs that end inside it, and the TPOT of requests
    that finish inside it. Times in seconds."""

    def __init__(self) -> None:
        self.on = False
        self.tokens = 0.0
        self.messages = 0
        self.itl: list[float] = []
        self.ttft: list[float] = []
        self.tpot: list[float] = []


class Timeline:
    """Arrival times of one request's token-carrying messages."""

    def __init__(self, meter: Meter | None = None) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.credited = 0  # tokens counted by the meter
        self.itl: list[float] = []
        self.meter = meter

    def arrived(self, tokens: int) -> None:
        """Record a message carrying `tokens` tokens (messages without tokens are not counted)."""
        if not tokens:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            gap = None
        else:
            gap = now - self.last
            self.itl.append(gap)
        self.last = now
        self.tokens += tokens
        m = self.meter
        if m is not None and m.on:
            m.tokens += tokens
            m.messages += 1
            self.credited += tokens
            if gap is None:
                m.ttft.append(now - self.start)
            else:
                m.itl.append(gap)

    def settle(self, total_tokens: int) -> None:
        """The request ended with `total_tokens` tokens in all, for protocols whose messages do
        not tell how many tokens they carry (counted as one each): the meter gets its share."""
        if self.meter is not None and self.tokens and total_tokens != self.tokens:
            self.meter.tokens += (total_tokens - self.tokens) * self.credited / self.tokens
        self.tokens = total_tokens

    def sample(self) -> Sample:
        """The request's timings, once its stream ended."""
        end = time.perf_counter()
        m = self.meter
        if m is not None and m.on and self.first is not None and self.tokens > 1:
            m.tpot.append((self.last - self.first) / (self.tokens - 1))
        return Sample(ttft=(self.first or end) - self.start, e2e=end - self.start, tokens=self.tokens, itl=self.itl)


class Client:
    """One protocol's streaming call; `run(prompt)` returns a Sample."""

    meter: Meter | None = None

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, prompt: str) -> Sample:
        raise NotImplementedError


class GrpcClient(Client):
    """Generate calls straight to the core. With `json_schema`, each request is constrained to
    that schema (guided decoding), so it cannot ask for ignore_eos: the schema must not let the
    output complete within max_new_tokens if every request is to generate as many tokens.
    With `adapters`, requests name them in turn (LoRA adapters the core serves)."""

    def __init__(
        self,
        address: str,
        max_new_tokens: int,
        chat: bool,
        json_schema: str | None = None,
        adapters: tuple[str, ...] = (),
    ):
        self.address, self.max_new_tokens, self.chat = address, max_new_tokens, chat
        self.json_schema = json_schema
        self.adapters = adapters
        self.turn = 0

    async def start(self) -> None:
        import grpc
        from trellis.generate.v1 import generate_pb2 as pb
        from trellis.generate.v1 import generate_service_pb2 as spb
        from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

        self.pb, self.spb = pb, spb
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = spb_grpc.GenerateServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def run(self, prompt: str) -> Sample:
        pb, spb = self.pb, self.spb
        stopping = pb.StoppingParams(max_new_tokens=self.max_new_tokens, ignore_eos=self.json_schema is None)
        if self.chat:
            msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=[pb.ContentPart(text=prompt)])])
            req = spb.GenerateRequest(messages=msgs, stopping=stopping)
        else:
            req = spb.GenerateRequest(text=prompt, stopping=stopping)
        if self.json_schema is not None:
            req.guided_decoding.json_schema = self.json_schema
        if self.adapters:
            req.adapter = self.adapters[self.turn % len(self.adapters)]
            self.turn += 1
        timeline = Timeline(self.meter)
        async for msg in self.stub.Generate(req):
            timeline.arrived(sum(len(o.tokens) for o in msg.outputs))
        return timeline.sample()


class MuxClient(Client):
    """Every request on one MultiplexGenerate stream, through the gateways' own core client
    (gateways.common.core_client): the core's cost behind a gateway, without the HTTP side.
    Requests ask for `steps`, as the gateways' streaming routes do; a step or message with text
    counts as one token, settled against usage.completion_tokens."""

    def __init__(self, address: str, max_new_tokens: int):
        self.address, self.max_new_tokens = address, max_new_tokens

    async def start(self) -> None:
        from trellis.generate.v1 import generate_pb2 as pb
        from trellis.generate.v1 import generate_service_pb2 as spb

        from gateways.common.core_client import CoreClient
        from gateways.common.streaming import CoreStream

        self.pb, self.spb, self.open = pb, spb, CoreStream.open
        self.client = CoreClient(self.address)

    async def close(self) -> None:
        await self.client.close()

    async def run(self, prompt: str) -> Sample:
        stopping = self.pb.StoppingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True)
        timeline = Timeline(self.meter)
        request = self.spb.GenerateRequest(text=prompt, stopping=stopping)
        stream = await self.open(self.client.generate(request, steps=True))
        last = None
        try:
            async for delta in stream:
                if isinstance(delta, tuple):  # a Step: (text, token_id, logprob)
                    timeline.arrived(1 if delta[0] else 0)
                    continue
                timeline.arrived(sum(1 for o in delta.outputs if o.text))
                last = delta
        finally:
            stream.cancel()
        if last is not None:
            timeline.settle(last.usage.completion_tokens)
        return timeline.sample()


class HttpClient(Client):
    def __init__(self, url: str, max_new_tokens: int, model: str):
        self.url, self.max_new_tokens, self.model = url.rstrip("/"), max_new_tokens, model

    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
        )

    async def close(self) -> None:
        await self.session.close()

    def request(self, prompt: str) -> tuple[str, dict]:
        raise NotImplementedError

    def tokens_in(self, line: bytes) -> int:
        """Tokens carried by one stream line (0 for framing and non-token records)."""
        raise NotImplementedError

    async def run(self, prompt: str) -> Sample:
        url, body = self.request(prompt)
        timeline = Timeline(self.meter)
        async with self.session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                timeline.arrived(self.tokens_in(line.strip()))
        return timeline.sample()


class OpenAIClient(HttpClient):
    ignore_eos = True  # a vLLM/LMI extension; leave it out for servers that reject it

    def request(self, prompt: str) -> tuple[str, dict]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "max_tokens": self.max_new_tokens,
            "temperature": 0,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return f"{self.url}/v1/chat/completions", body

    def tokens_in(self, line: bytes) -> int:
        # One chunk carries one token (every server measured here streams token by token); a
        # byte search keeps the client's cost per token small and equal across HTTP targets.
        return 1 if line.startswith(b"data:") and _CONTENT.search(line) else 0


class LmiClient(HttpClient):
    def request(self, prompt: str) -> tuple[str, dict]:
        return f"{self.url}/invocations", {
            "inputs": prompt,
            "stream": True,
            "parameters": {"max_new_tokens": self.max_new_tokens, "ignore_eos_token": True},
        }

    def tokens_in(self, line: bytes) -> int:
        return 1 if line.startswith(b"{") and b'"token"' in line else 0


class TritonClient(HttpClient):
    def request(self, prompt: str) -> tuple[str, dict]:
        return f"{self.url}/v2/models/{self.model}/generate_stream", {
            "text_input": prompt,
            "parameters": {"max_tokens": self.max_new_tokens, "end_id": -1},
        }

    def tokens_in(self, line: bytes) -> int:
        return 1 if line.startswith(b"data:") and b'"text_output"' in line else 0


class WsClient(Client):
    """One prompt per batch frame (stream_response, a new request_id each time, so no session
    continues), on a pool of sockets: each concurrent stream keeps one socket. PROGRESS events
    are counted as one token each, settled against COMPLETE's new_tokens_count."""

    def __init__(self, url: str, max_new_tokens: int):
        self.url, self.max_new_tokens = url, max_new_tokens
        self.ids = itertools.count()
        self.pool: list[Any] = []

    async def close(self) -> None:
        for ws in self.pool:
            await ws.close()
        self.pool.clear()

    async def run(self, prompt: str) -> Sample:
        from websockets.asyncio.client import connect

        ws = self.pool.pop() if self.pool else await connect(self.url, max_size=None, ping_interval=None)
        rid = f"loadgen-{id(self)}-{next(self.ids)}"
        frame = {
            "prompts": [{"request_id": rid, "prompt": prompt}],
            "stream_response": True,
            "generation_config": {"max_new_tokens": self.max_new_tokens},
        }
        timeline = Timeline(self.meter)
        await ws.send(json.dumps(frame))
        while True:
            events = json.loads(await ws.recv())
            for event in events:
                kind = event.get("type")
                if kind == "PROGRESS":
                    timeline.arrived(1)
                elif kind == "COMPLETE":
                    timeline.settle(event["new_tokens_count"])
                    self.pool.append(ws)
                    return timeline.sample()
                elif kind == "ERROR" or kind is None:
                    await ws.close()
                    raise RuntimeError(f"ws: {event}")


def make_client(args) -> Client:
    if args.target == "grpc":
        return GrpcClient(args.address, args.max_new_tokens, args.chat)
    if args.target == "mux":
        return MuxClient(args.address, args.max_new_tokens)
    if args.target == "ws":
        return WsClient(args.url, args.max_new_tokens)
    cls = {"openai": OpenAIClient, "lmi": LmiClient, "triton": TritonClient}[args.target]
    client = cls(args.url, args.max_new_tokens, args.model)
    if args.no_ignore_eos:
        client.ignore_eos = False
    return client


async def run_load(
    client: Client, concurrency: int, requests: int, warmup: int, label: str, max_new_tokens: int, progress: bool = True
) -> Result:
    """Run the closed loop and aggregate (see the module docstring)."""
    await client.start()
    try:
        await asyncio.gather(*(client.run(PROMPTS[i % len(PROMPTS)]) for i in range(warmup)))
        samples: list[Sample] = []
        errors = 0
        issued = 0

        async def worker(w: int) -> None:
            nonlocal issued, errors
            while issued < requests:
                i = issued
                issued += 1
                try:
                    samples.append(await client.run(PROMPTS[(i + w) % len(PROMPTS)]))
                except Exception as e:  # counted, reported, and the loop goes on
                    errors += 1
                    print(f"  request failed: {e}", file=sys.stderr)
                if progress and (len(samples) + errors) % max(1, requests // 4) == 0:
                    print(f"  {label}: {len(samples) + errors}/{requests}", flush=True)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    tokens = sum(s.tokens for s in samples)
    tpot = [(s.e2e - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    return Result(
        target=label,
        concurrency=concurrency,
        requests=len(samples),
        max_new_tokens=max_new_tokens,
        wall_s=wall,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall,
        requests_per_s=len(samples) / wall,
        ttft_ms=_pct([s.ttft for s in samples]),
        itl_ms=_pct([x for s in samples for x in s.itl]),
        tpot_ms=_pct(tpot),
        e2e_ms=_pct([s.e2e for s in samples]),
        errors=errors,
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=["grpc", "mux", "openai", "lmi", "triton", "ws"])
    p.add_argument("--address", default="127.0.0.1:50051", help="core address (grpc)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (HTTP targets; ws://.../ws)")
    p.add_argument("--model", default="demo", help="model name (openai, triton)")
    p.add_argument("--chat", action="store_true", help="grpc: send chat messages (like the openai target)")
    p.add_argument("--no-ignore-eos", action="store_true", help="openai: leave out ignore_eos (servers without it)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output", help="write the result as JSON here")
    args = p.parse_args(argv)
    result = asyncio.run(
        run_load(make_client(args), args.concurrency, args.requests, args.warmup, args.target, args.max_new_tokens)
    )
    print(result.row())
    if args.output:
        with open(args.output, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0 if result.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
