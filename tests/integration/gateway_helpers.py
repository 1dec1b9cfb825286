"""Helpers for tests that talk to the gateways over HTTP and WebSocket: each schema's error
sentences for core failures, stream parsing, and one successful call per gateway (a probe)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import aiohttp
from websockets.asyncio.client import connect

# The gateways' sentences for core failures (docs/architecture.md, "Errors").
INCOMPLETE = "The model server ended the response before it finished."
CANCELLED = "The model server cancelled the request before it finished; retry it."
CLOSED = "The model server closed the connection; retry."
UNREACHABLE = "The model server cannot be reached."
#: What a stream in flight may end with when its core dies: the connection seen closing, the
#: call cancelled, or (when the gateway's stream to the core broke before this call was on it)
#: the core unreachable.
CORE_LOST = (CLOSED, CANCELLED, UNREACHABLE)

GATEWAYS = ("lmi", "openai", "triton", "ws")

#: Each gateway's readiness route: 200 while its core is SERVING. Not ready is 503, except on
#: Triton, whose /v2/health/ready answers 400 (Triton's own answer; KServe v2 asks for a 4xx).
HEALTH = {"lmi": "/ping", "openai": "/health", "triton": "/v2/health/ready", "ws": "/health"}
NOT_READY = {"lmi": 503, "openai": 503, "triton": 400, "ws": 503}


def ws_url(base: str) -> str:
    """The WebSocket route of the gateway at `base` (http://host:port)."""
    return "ws" + base[len("http") :] + "/ws"


def records(text: str) -> list:
    """The JSON records of a jsonlines or SSE body (SSE's `[DONE]` left out)."""
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.strip()]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def lmi_error(message: str) -> dict:
    """LMI's rolling-batch error body (docs/lmi.md, "Errors"), with the message."""
    details = {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None}
    return {"generated_text": "", "details": details, "error": message}


def lmi_stream_error(message: str) -> dict:
    """The last line of an LMI stream that failed after its first byte."""
    return {
        "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
        "error": message,
    }


def openai_error(message: str, code: str) -> dict:
    """OpenAI's error object as the gateway sends it for a core failure."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


# ------------------------------------------------------------------------------ probes


async def lmi(http: aiohttp.ClientSession, base: str, model: str = "mock") -> bool:
    """One short LMI call; True if it succeeded."""
    async with http.post(base + "/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}) as r:
        return r.status == 200


async def openai(http: aiohttp.ClientSession, base: str, model: str = "mock") -> bool:
    """One short chat completion; True if it succeeded."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        return r.status == 200


async def triton(http: aiohttp.ClientSession, base: str, model: str = "mock") -> bool:
    """One short Triton generate call; True if it succeeded."""
    async with http.post(base + f"/v2/models/{model}/generate", json={"text_input": "x", "max_tokens": 1}) as r:
        return r.status == 200


async def ws(http: aiohttp.ClientSession, base: str, model: str = "mock") -> bool:
    """One prompt on a new WebSocket; True if it COMPLETEd (False on ERROR or a refused socket)."""
    try:
        async with connect(ws_url(base)) as sock:
            body = {"prompts": [{"request_id": "r", "prompt": "x"}], "generation_config": {"max_new_tokens": 1}}
            await sock.send(json.dumps(body))
            while True:
                for event in json.loads(await sock.recv()):
                    if event.get("type") in ("COMPLETE", "ERROR"):
                        return bool(event["type"] == "COMPLETE")
    except OSError:
        return False


Probe = Callable[[aiohttp.ClientSession, str], Awaitable[bool]]
PROBES: dict[str, Probe] = {"lmi": lmi, "openai": openai, "triton": triton, "ws": ws}


async def first_success(probe: Probe, http: aiohttp.ClientSession, base: str, since: float) -> float:
    """Seconds from `since` (time.monotonic()) until `probe` succeeds (polled every 50 ms)."""
    while True:
        try:
            if await probe(http, base):
                return time.monotonic() - since
        except aiohttp.ClientError:
            pass  # the gateway answered nothing usable yet
        await asyncio.sleep(0.05)
