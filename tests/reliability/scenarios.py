"""The reliability scenarios as functions, shared by the short tests in tests/reliability/ and by
`make soak` (scripts/bench/soak.py), which runs them longer and writes their figures:

- `storm`: streams through the four gateways abandoned at random points;
- `core_kill`: the core killed (SIGKILL) with streams in flight through every gateway, then
  restarted on the same address;
- `drain`: the core stopped gracefully (SIGTERM) with streams in flight.

Each takes the gateways' base URLs ({"lmi": "http://127.0.0.1:PORT", ...}, as
tests.integration.gateway_helpers.GATEWAYS names them, on a core serving model "mock") and
callables that act on the core, so a test can use in-process servers or processes and the soak
its own processes. `core_kill` and `drain` return their figures with a list of `problems`
(empty when every expectation held), so a test asserts it empty and the soak reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.integration.gateway_helpers import (
    CORE_LOST,
    GATEWAYS,
    HEALTH,
    NOT_READY,
    PROBES,
    first_success,
    lmi_stream_error,
    records,
    ws_url,
)

LONG = 2000  # tokens: a stream that does not end on its own during a scenario


def stream_request(name: str, base: str, tokens: int) -> tuple[str, dict]:
    """URL and body of a streaming request for `tokens` tokens (EOS ignored) on HTTP gateway `name`."""
    if name == "openai":
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        return base + "/v1/chat/completions", {**body, "max_tokens": tokens, "ignore_eos": True}
    if name == "lmi":
        params = {"max_new_tokens": tokens, "ignore_eos_token": True}
        return base + "/invocations", {"inputs": "hi", "stream": True, "parameters": params}
    return base + "/v2/models/mock/generate_stream", {"text_input": "hi", "max_tokens": tokens, "end_id": -1}


def ws_frame(ids: list[str], tokens: int) -> str:
    """A WebSocket batch frame of one prompt per id, `tokens` tokens each."""
    prompts = [{"request_id": rid, "prompt": "hi"} for rid in ids]
    return json.dumps({"prompts": prompts, "generation_config": {"max_new_tokens": tokens}})


# ------------------------------------------------------------------------------ disconnect storm


async def _http_stream(http: aiohttp.ClientSession, url: str, body: dict, lines: int) -> None:
    async with http.post(url, json=body) as resp:
        for _ in range(lines):
            await resp.content.readline()


async def _ws_stream(url: str, frames: int) -> None:
    async with connect(url) as sock:
        await sock.send(ws_frame([str(i) for i in range(3)], LONG))
        for _ in range(frames):
            await sock.recv()


async def storm(
    urls: dict[str, str], streams: int, rng: random.Random, max_records: int = 5, concurrency: int | None = None
) -> dict[str, int]:
    """Start `streams` streams round-robin across the gateways and abandon each at a random
    point: 20% before the first byte (cancelled within 10 ms of the start), the others after 0 to
    `max_records` records (lines, or WebSocket frames of a 3-prompt batch) or after a random
    wait of up to 1 s (a queued request sends nothing yet). At most `concurrency` at once (all at
    once when None). Returns {"streams", "before_first_byte"}."""
    targets = []
    for name in GATEWAYS:
        if name == "ws":
            targets.append(lambda http, k: _ws_stream(ws_url(urls["ws"]), k))
        else:
            url, body = stream_request(name, urls[name], LONG)
            targets.append(lambda http, k, url=url, body=body: _http_stream(http, url, body, k))
    limit = asyncio.Semaphore(concurrency or streams)
    early = 0

    async def abandon(target, http: aiohttp.ClientSession, records: int, after: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(after):
                await target(http, records)

    async def one(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal early
        target = targets[i % len(targets)]
        async with limit:
            task = asyncio.create_task(abandon(target, http, rng.randint(0, max_records), rng.random()))
            if rng.random() < 0.2:  # before the first byte
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
                early += 1
            await asyncio.gather(task, return_exceptions=True)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(one(i, http) for i in range(streams)))
    return {"streams": streams, "before_first_byte": early}


async def next_requests_start(urls: dict[str, str]) -> float:
    """Seconds until one short request on each gateway, sent together, has all been served:
    after a storm on a core with 4 batch slots, a leaked slot would hold one of them back."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        assert all(await asyncio.gather(*(PROBES[name](http, urls[name]) for name in GATEWAYS)))
    return time.monotonic() - started


# ------------------------------------------------------------------------------ streams in flight


async def _read_http(http: aiohttp.ClientSession, url: str, body: dict, first: asyncio.Event) -> tuple[int, str]:
    """Status and whole body of a streamed response; `first` is set once its first line arrived."""
    async with http.post(url, json=body) as resp:
        lines = []
        async for line in resp.content:
            lines.append(line.decode())
            if line.strip():
                first.set()
        return resp.status, "".join(lines)


async def _read_ws(url: str, ids: list[str], tokens: int, first: asyncio.Event) -> list[dict]:
    """Every event of one batch frame until each prompt COMPLETEs or fails (or the socket
    closes); `first` is set at the first PROGRESS."""
    events: list[dict] = []
    async with connect(url) as sock:
        await sock.send(ws_frame(ids, tokens))
        done: set[str] = set()
        with contextlib.suppress(ConnectionClosed):  # a closed socket ends the list
            while done != set(ids):
                for event in json.loads(await sock.recv()):
                    events.append(event)
                    if event.get("type") == "PROGRESS":
                        first.set()
                    if event.get("type") in ("COMPLETE", "ERROR"):
                        done.add(event.get("request_id", ""))
    return events


class InFlight:
    """One stream through each gateway (and, with `core`, one Generate call straight to the core
    at that address), started together; `started()` waits for every first token."""

    def __init__(self, urls: dict[str, str], tokens: int, core: str | None = None):
        self.tokens = tokens
        self.firsts = {name: asyncio.Event() for name in [*GATEWAYS, *(["grpc"] if core else [])]}
        self.http = aiohttp.ClientSession()
        self.tasks: dict[str, asyncio.Task] = {}
        for name in GATEWAYS:
            if name == "ws":
                coro = _read_ws(ws_url(urls[name]), ["in-flight"], tokens, self.firsts[name])
            else:
                coro = _read_http(self.http, *stream_request(name, urls[name], tokens), self.firsts[name])
            self.tasks[name] = asyncio.create_task(coro)
        if core:
            self.tasks["grpc"] = asyncio.create_task(self._grpc(core))

    async def _grpc(self, address: str) -> list[spb.GenerateResponse]:
        async with grpc.aio.insecure_channel(address) as channel:
            stopping = pb.StoppingParams(max_new_tokens=self.tokens, ignore_eos=True)
            msgs = []
            async for msg in spb_grpc.GenerateServiceStub(channel).Generate(
                spb.GenerateRequest(text="hi", stopping=stopping)
            ):
                msgs.append(msg)
                if msg.outputs:
                    self.firsts["grpc"].set()
            return msgs

    async def started(self, within: float = 30.0) -> None:
        """Wait until every stream has its first token.

        Raises:
            AssertionError: a stream ended before its first token (with what it got), or
                `within` seconds passed.
        """
        deadline = time.monotonic() + within
        while not all(e.is_set() for e in self.firsts.values()):
            for name, task in self.tasks.items():
                if task.done() and not self.firsts[name].is_set():
                    await self.http.close()
                    got = task.exception() or task.result()
                    raise AssertionError(f"{name} ended before its first token: {got!r:.500}")
            assert time.monotonic() < deadline, f"no first token within {within} s"
            await asyncio.sleep(0.01)

    async def results(self, within: float = 60.0) -> dict[str, Any]:
        """Each stream's outcome: (status, body) for HTTP, the events for WebSocket, the
        messages (or the AioRpcError) for gRPC."""
        try:
            done = await asyncio.wait_for(asyncio.gather(*self.tasks.values(), return_exceptions=True), within)
        finally:
            await self.http.close()
        return dict(zip(self.tasks, done, strict=True))


def in_band_error_problems(results: dict[str, Any]) -> list[str]:
    """What differs from each schema's in-band error for a core lost mid-stream (with one of the
    gateways' sentences for it, `CORE_LOST`): LMI's error line, OpenAI's error event then
    `[DONE]`, Triton's error event, the WebSocket ERROR event."""
    problems = []
    for name in GATEWAYS:
        got = results[name]
        if isinstance(got, BaseException):
            problems.append(f"{name}: the stream failed on the client: {got!r}")
            continue
        if name == "ws":
            last = got[-1] if got else {}
            if last.get("type") != "ERROR" or last.get("error") not in CORE_LOST:
                problems.append(f"ws: last event {last}")
            continue
        status, text = got
        recs = records(text)
        last = recs[-1] if recs else None
        if name == "lmi":
            ok = last in [lmi_stream_error(m) for m in CORE_LOST]
        elif name == "openai":
            ok = _is_openai_error(last) and text.endswith("data: [DONE]\n\n")
        else:
            ok = last in [{"error": m} for m in CORE_LOST]
        if status != 200 or not ok:
            problems.append(f"{name}: status {status}, ends with {text[-300:]!r}")
    return problems


def _is_openai_error(record: Any) -> bool:
    if not isinstance(record, dict) or set(record) != {"error"}:
        return False
    err = record["error"]
    return (
        set(err) == {"message", "type", "param", "code"}
        and err["message"] in CORE_LOST
        and err["type"] == "server_error"
        and isinstance(err["code"], str)
    )


async def health(http: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, int]:
    """Each gateway's readiness route's status."""

    async def one(name: str) -> int:
        async with http.get(urls[name] + HEALTH[name]) as r:
            return r.status

    return dict(zip(GATEWAYS, await asyncio.gather(*(one(n) for n in GATEWAYS)), strict=True))


# ------------------------------------------------------------------------------ core killed


async def core_kill(
    urls: dict[str, str],
    kill: Callable[[], Awaitable[None]],
    restart: Callable[[], Awaitable[None]],
    outage_s: float = 1.0,
) -> dict[str, Any]:
    """SIGKILL the core (`kill()`: returns once it is dead) while one stream runs through each
    gateway, keep it down `outage_s` seconds, `restart()` it on the same address (returns once
    it serves), and measure per gateway the seconds from then to the first successful call.

    Expected: each stream ends with its schema's in-band error, every readiness route
    reports not ready while the core is down (`NOT_READY`), and every gateway serves again
    without a restart of its own. Returns {"recovery_s": {gateway: s}, "not_ready_s": {gateway:
    s from the kill until its readiness route said so, polled once the streams ended},
    "problems": [...]}."""
    problems: list[str] = []
    flight = InFlight(urls, LONG)
    await flight.started()
    killed = time.monotonic()
    await kill()
    problems += in_band_error_problems(await flight.results())
    not_ready: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while len(not_ready) < len(GATEWAYS) and time.monotonic() < deadline:
            for name, status in (await health(http, urls)).items():
                if status == NOT_READY[name] and name not in not_ready:
                    not_ready[name] = round(time.monotonic() - killed, 3)
            await asyncio.sleep(0.05)
        problems += [f"{n}: readiness never reported not ready" for n in GATEWAYS if n not in not_ready]
        for name, probe in PROBES.items():
            if await asyncio.wait_for(probe(http, urls[name]), 10):
                problems.append(f"{name}: a call succeeded with the core down")
        await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - killed)))
        await restart()
        back = time.monotonic()
        took = await asyncio.wait_for(
            asyncio.gather(*(first_success(PROBES[n], http, urls[n], back) for n in GATEWAYS)), 60
        )
        ready = await health(http, urls)
        problems += [f"{n}: readiness {s} after the core came back" for n, s in ready.items() if s != 200]
    return {
        "recovery_s": {n: round(t, 3) for n, t in zip(GATEWAYS, took, strict=True)},
        "not_ready_s": not_ready,
        "problems": problems,
    }


# ------------------------------------------------------------------------------ graceful drain


async def drain(
    urls: dict[str, str],
    core: str,
    terminate: Callable[[], None],
    exited: Callable[[], Awaitable[None]],
    drain_seconds: float,
    tokens: int,
) -> dict[str, Any]:
    """Start a stream of `tokens` tokens through each gateway and one Generate call on the core
    at address `core`, `terminate()` the core (SIGTERM) once every stream has its first token,
    then send a new call straight to the core and one through each gateway.

    Expected (docs/architecture.md, "Shutdown"): the streams in flight finish complete (`tokens`
    tokens each: choose `tokens` so they fit in `drain_seconds`), the new calls are refused at
    once (UNAVAILABLE on gRPC, 503 on HTTP, an ERROR event on WebSocket), and the process exits
    (`exited()` returns) within `drain_seconds` + 0.5 s. Returns {"exit_s", "refusal_s":
    {target: s}, "problems": [...]}."""
    problems: list[str] = []
    flight = InFlight(urls, tokens, core)
    await flight.started()
    started = time.monotonic()
    terminate()
    exit_task = asyncio.create_task(exited())
    refusal: dict[str, float] = {}
    async with grpc.aio.insecure_channel(core) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        t0 = time.monotonic()
        try:
            await stub.Generate(spb.GenerateRequest(text="new")).read()
            problems.append("grpc: a new call was accepted while draining")
        except grpc.aio.AioRpcError as e:
            refusal["grpc"] = round(time.monotonic() - t0, 3)
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                problems.append(f"grpc: a new call got {e.code().name}, not UNAVAILABLE")
    async with aiohttp.ClientSession() as http:
        for name in ("lmi", "openai", "triton"):
            url, body = stream_request(name, urls[name], 2)
            t0 = time.monotonic()
            async with http.post(url, json=body) as resp:
                await resp.read()
                refusal[name] = round(time.monotonic() - t0, 3)
                if resp.status != 503:
                    problems.append(f"{name}: a new call got {resp.status}, not 503")
    t0 = time.monotonic()
    last = await _ws_outcome(ws_url(urls["ws"]))
    refusal["ws"] = round(time.monotonic() - t0, 3)
    if last.get("type") != "ERROR":
        problems.append(f"ws: a new prompt got {last}, not an ERROR event")
    for name, got in (await flight.results()).items():
        problems += [f"{name}: {p}" for p in complete_problems(name, got, tokens)]
    await exit_task
    exit_s = time.monotonic() - started
    if exit_s > drain_seconds + 0.5:
        problems.append(f"the core exited {exit_s:.2f} s after SIGTERM (--drain-seconds {drain_seconds})")
    return {"exit_s": round(exit_s, 3), "refusal_s": refusal, "problems": problems}


async def _ws_outcome(url: str) -> dict:
    """The COMPLETE or ERROR event of one new short prompt on a new socket ({} if it closed)."""
    with contextlib.suppress(ConnectionClosed):
        async with connect(url) as sock:
            await sock.send(ws_frame(["new"], 2))
            while True:
                for event in json.loads(await sock.recv()):
                    if event.get("type") in ("COMPLETE", "ERROR"):
                        return event
    return {}


def complete_problems(name: str, got: Any, tokens: int) -> list[str]:
    """What shows that a stream in flight did not finish complete with `tokens` tokens."""
    if isinstance(got, BaseException):
        return [f"failed: {got!r}"]
    if name == "grpc":
        last = got[-1]
        return [] if last.usage.completion_tokens == tokens else [f"ended with {last}"]
    if name == "ws":
        last = got[-1] if got else {}
        ok = last.get("type") == "COMPLETE" and last.get("new_tokens_count") == tokens
        return [] if ok else [f"ended with {last}"]
    status, text = got
    recs = records(text)
    last = recs[-1] if recs else {}
    if name == "openai":
        ok = last["choices"][0]["finish_reason"] == "length" and text.endswith("data: [DONE]\n\n")
    elif name == "lmi":
        ok = "generated_text" in last and "error" not in last and sum("token" in r for r in recs) == tokens
    else:
        ok = last.get("finish_reason") == "length"
    return [] if status == 200 and ok else [f"status {status}, ends with {text[-300:]!r}"]
