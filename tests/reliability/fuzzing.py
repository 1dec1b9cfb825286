"""Fuzzing inputs and runners shared by tests/reliability/test_fuzz.py (a few hundred cases, in
seconds) and `make soak` (more examples): hypothesis-drawn request bodies for every HTTP gateway,
WebSocket frames, GenerateRequests through the real core, and hand-made hostile cases.

The cases are drawn up front (`draw`: a hypothesis run that collects its examples, with a fixed
seed), then sent over real connections. Each runner returns {"cases", "4xx", "5xx"}: answers
that are client errors, and answers that are server failures (HTTP 5xx; on gRPC INTERNAL or
UNKNOWN or RESOURCE_EXHAUSTED; on WebSocket a socket dropped or a prompt never answered). Process deaths and
tracebacks are counted by the caller, which knows the processes and their logs.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

from tests.integration.gateway_helpers import ws_url

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with some of the schema's own fields (right or wrong types) and stray keys."""
    known = st.fixed_dictionaries({}, optional={k: st.one_of(v, VALUES) for k, v in fields.items()})
    return st.tuples(known, st.dictionaries(st.text(max_size=10), VALUES, max_size=2)).map(lambda t: {**t[1], **t[0]})


MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]), "content": VALUES}),
    max_size=3,
)
SMALL_INTS = st.integers(min_value=-5, max_value=5000)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": SMALL_INTS,
        "temperature": st.floats(allow_nan=False, allow_infinity=False),
        "top_p": st.floats(allow_nan=False, allow_infinity=False),
        "top_k": SMALL_INTS,
        "do_sample": st.booleans(),
        "stop_sequences": st.lists(st.text(max_size=5), max_size=3),
        "details": st.booleans(),
        "seed": st.integers(min_value=-(2**64), max_value=2**64),
    },
)
SCHEMAS = {
    ("openai", "/v1/chat/completions"): _bodies(
        {
            "model": st.sampled_from(["mock", "other"]),
            "messages": MESSAGES,
            "max_tokens": SMALL_INTS,
            "temperature": st.floats(allow_nan=False, allow_infinity=False),
            "n": SMALL_INTS,
            "stop": st.lists(st.text(max_size=5), max_size=5),
            "logprobs": st.booleans(),
            "top_logprobs": SMALL_INTS,
            "logit_bias": st.dictionaries(st.text(max_size=6), st.integers(-200, 200), max_size=3),
            "stream": st.booleans(),
            "seed": st.integers(min_value=-(2**64), max_value=2**64),
        }
    ),
    ("lmi", "/invocations"): _bodies({"inputs": VALUES, "parameters": PARAMS, "stream": st.booleans()}),
    ("triton", "/v2/models/mock/generate"): _bodies(
        {"text_input": VALUES, "max_tokens": SMALL_INTS, "stop_words": VALUES, "id": VALUES}
    ),
    ("triton", "/v2/models/mock/generate_stream"): _bodies(
        {"text_input": st.text(max_size=20), "max_tokens": SMALL_INTS, "temperature": VALUES}
    ),
}


def draw(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """n examples of `strategy`, the same on every run."""
    out: list[Any] = []

    @seed(20261123)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out[:n]


HOSTILE = [
    b'{"inputs": NaN}',
    b'{"inputs": Infinity, "text_input": -Infinity}',
    b'{"max_tokens": 1' + b"0" * 400 + b"}",
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 100 + b"1" + b"}" * 100,
    b'{"inputs": "\xff\xfe"}',
    b'{"inputs": "a\\ud800b", "text_input": "\\udfff", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b"",
    b"null",
    b'"just a string"',
    b'{"inputs": "hi", "inputs": 3}',
    json.dumps({"inputs": "x" * 1_500_000, "text_input": "x" * 1_500_000}).encode(),
]


FRAMES = st.one_of(
    VALUES.map(json.dumps),
    st.text(max_size=50),
    st.fixed_dictionaries(
        {"prompts": st.lists(st.fixed_dictionaries({"request_id": VALUES, "prompt": VALUES}), max_size=3)},
        optional={"generation_config": st.dictionaries(st.text(max_size=12), VALUES, max_size=3)},
    ).map(json.dumps),
)


def _mostly(valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Values in range most of the time, anything else otherwise: a request with every field
    drawn at random is nearly always refused at its first field, and the paths behind validation
    (sampling, stop strings, logit_bias in the engine) would go unfuzzed."""
    return st.one_of(valid, valid, valid, anything)


GENERATE = st.builds(
    spb.GenerateRequest,
    text=_mostly(st.text(min_size=1, max_size=30), st.text(max_size=30)),
    model=st.sampled_from(["", "", "mock", "other", "x" * 100_000]),
    request_id=st.text(max_size=20),
    sampling=st.builds(
        pb.SamplingParams,
        do_sample=st.booleans(),
        temperature=_mostly(st.floats(0, 2, width=32), st.floats(width=32)),
        top_p=_mostly(st.floats(0.0625, 1, width=32), st.floats(width=32)),
        top_k=_mostly(st.integers(0, 50), st.integers(-10, 10**6)),
        n=_mostly(st.integers(1, 4), st.integers(0, 100)),
        seed=st.integers(0, 2**63 - 1),
        logit_bias=st.dictionaries(
            _mostly(st.integers(0, 4095), st.integers(-10, 10**6)),
            _mostly(st.floats(-100, 100, width=32), st.floats(width=32)),
            max_size=3,
        ),
    ),
    stopping=st.builds(
        pb.StoppingParams,
        max_new_tokens=st.integers(0, 10**6),
        stop=st.lists(_mostly(st.text(min_size=1, max_size=8), st.text(max_size=8)), max_size=20),
        truncate_input_tokens=st.integers(0, 10),
    ),
)


#: Codes a fuzzed request must never get. RESOURCE_EXHAUSTED is among them: the requests go one
#: at a time, so the core's queue is never full, and that code (which gateways answer with 429
#: and Retry-After) can only come from a failure such as a status over gRPC's metadata limit.
SERVER_FAILURES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED)


async def fuzz_http(urls: dict[str, str], n: int) -> dict[str, Any]:
    """`n` drawn bodies per route of `SCHEMAS` plus `HOSTILE`, posted as JSON to the gateways at
    `urls`; also {"statuses": {status: count}, "failures": [the first few 5xx cases]}."""
    statuses: dict[int, int] = {}
    failures: list[str] = []
    async with aiohttp.ClientSession() as http:
        for (gateway, path), strategy in SCHEMAS.items():
            for body in [json.dumps(b).encode() for b in draw(strategy, n)] + HOSTILE:
                async with http.post(
                    urls[gateway] + path, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                if resp.status >= 500 and len(failures) < 5:
                    failures.append(f"{gateway} {path} {resp.status}: {body[:300]!r}")
    return {
        "cases": sum(statuses.values()),
        "4xx": sum(c for s, c in statuses.items() if 400 <= s < 500),
        "5xx": sum(c for s, c in statuses.items() if s >= 500),
        "statuses": statuses,
        "failures": failures,
    }


async def fuzz_ws(url: str, n: int) -> dict[str, Any]:
    """`n` drawn frames, 5,000 prompts in one frame, a lone surrogate, deep nesting and a binary
    frame on one socket to the WebSocket gateway at `url` (its http:// base), then a good prompt
    that must COMPLETE. "4xx" counts the frames refused with an error event; "5xx" is 1 if the
    socket dropped or the good prompt got no answer."""
    frames = [*draw(FRAMES, n), json.dumps({"prompts": [{"request_id": str(i), "prompt": "x"} for i in range(5000)]})]
    frames += ['{"prompts":[{"request_id":"s","prompt":"a\\ud800"}]}', "[" * 3000]
    refused, failed = 0, 0
    try:
        async with connect(ws_url(url), max_size=None) as ws:
            for frame in frames:
                await ws.send(frame)
            await ws.send(b"\x00\x01binary")
            await ws.send(json.dumps({"prompts": [{"request_id": "last-one", "prompt": "Hello"}]}))
            done = False
            while not done:
                for event in json.loads(await ws.recv()):
                    refused += "request_id" not in event and "error" in event
                    done |= event.get("request_id") == "last-one" and event.get("type") in ("COMPLETE", "ERROR")
    except Exception:  # a dropped socket is the failure counted
        failed = 1
    return {"cases": len(frames) + 2, "4xx": refused, "5xx": failed}


async def fuzz_grpc(address: str, n: int) -> dict[str, Any]:
    """`n` drawn GenerateRequests (at most 8 new tokens each) to the core at `address`; also
    {"codes": {status code name: count}, "failures": [the first few INTERNAL/UNKNOWN cases]}."""
    codes: dict[str, int] = {}
    failures: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        for request in draw(GENERATE, n):
            request.stopping.max_new_tokens = min(request.stopping.max_new_tokens, 8) or request.stopping.max_new_tokens
            try:
                async for _ in stub.Generate(request, timeout=30):
                    pass
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                code = e.code()
            codes[code.name] = codes.get(code.name, 0) + 1
            if code in SERVER_FAILURES and len(failures) < 5:
                failures.append(f"{code.name}: {str(request)[:300]}")
    return {
        "cases": sum(codes.values()),
        "4xx": sum(c for name, c in codes.items() if name != "OK") - sum(codes.get(c.name, 0) for c in SERVER_FAILURES),
        "5xx": sum(codes.get(code.name, 0) for code in SERVER_FAILURES),
        "codes": codes,
        "failures": failures,
    }
