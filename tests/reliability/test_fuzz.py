"""Fuzzing, short version (bounded: a few hundred cases in seconds): hypothesis-drawn request
bodies for every HTTP gateway, WebSocket frames, and GenerateRequests through the real core,
plus hand-made hostile cases. Every answer must be a client error or a success in the schema's
shape: no 5xx, no dropped socket, no process failure, no traceback in the log.

The cases are drawn once per test (`_draw`: a hypothesis run that collects its examples, with
a fixed seed), then sent over real connections.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc
from websockets.asyncio.client import connect

pytestmark = pytest.mark.timeout(240)

CASES = 60  # per strategy here; `make soak` draws more

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


def _draw(strategy: st.SearchStrategy[Any], n: int = CASES) -> list[Any]:
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


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records with a traceback logged by Trellis itself (other tests' clients may knock on
    these ports meanwhile, and aiohttp logs what they send under its own name)."""
    return [r for r in caplog.records if r.exc_info and r.name.split(".")[0] in ("core", "gateways")]


@pytest.fixture(scope="module")
async def gateways(mock_core, start_gateway):
    return {name: await start_gateway(name, core=mock_core.address) for name in ("openai", "lmi", "triton", "ws")}


async def test_fuzzed_http_bodies_get_no_5xx(gateways, caplog):
    statuses: dict[int, int] = {}
    with caplog.at_level(logging.INFO):
        async with aiohttp.ClientSession() as http:
            for (gateway, path), strategy in SCHEMAS.items():
                cases = [json.dumps(b).encode() for b in _draw(strategy)] + HOSTILE
                for body in cases:
                    async with http.post(
                        gateways[gateway] + path, data=body, headers={"Content-Type": "application/json"}
                    ) as resp:
                        await resp.read()
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1
                        assert resp.status < 500, (gateway, path, body[:300], resp.status)
    assert sum(statuses.values()) >= 4 * CASES
    assert not tracebacks(caplog), "a traceback was logged"


FRAMES = st.one_of(
    VALUES.map(json.dumps),
    st.text(max_size=50),
    st.fixed_dictionaries(
        {"prompts": st.lists(st.fixed_dictionaries({"request_id": VALUES, "prompt": VALUES}), max_size=3)},
        optional={"generation_config": st.dictionaries(st.text(max_size=12), VALUES, max_size=3)},
    ).map(json.dumps),
)


async def test_fuzzed_websocket_frames_never_drop_the_socket(gateways, caplog):
    frames = [*_draw(FRAMES), json.dumps({"prompts": [{"request_id": str(i), "prompt": "x"} for i in range(5000)]})]
    frames += ['{"prompts":[{"request_id":"s","prompt":"a\\ud800"}]}', "[" * 3000]
    with caplog.at_level(logging.INFO):
        async with connect(gateways["ws"].replace("http", "ws") + "/ws", max_size=None) as ws:
            for frame in frames:
                await ws.send(frame)
            await ws.send(b"\x00\x01binary")
            await ws.send(json.dumps({"prompts": [{"request_id": "last-one", "prompt": "Hello"}]}))
            done = False
            while not done:
                for event in json.loads(await ws.recv()):
                    done |= event.get("request_id") == "last-one" and event.get("type") in ("COMPLETE", "ERROR")
    assert not tracebacks(caplog), "a traceback was logged"


GENERATE = st.builds(
    spb.GenerateRequest,
    text=st.text(max_size=30),
    model=st.sampled_from(["", "mock", "x" * 100_000]),
    request_id=st.text(max_size=20),
    sampling=st.builds(
        pb.SamplingParams,
        temperature=st.floats(width=32),
        top_p=st.floats(width=32),
        top_k=st.integers(-10, 10**6),
        n=st.integers(0, 100),
        seed=st.integers(0, 2**63 - 1),
        logit_bias=st.dictionaries(st.integers(-10, 10**6), st.floats(width=32), max_size=3),
    ),
    stopping=st.builds(
        pb.StoppingParams,
        max_new_tokens=st.integers(0, 10**6),
        stop=st.lists(st.text(max_size=8), max_size=20),
        truncate_input_tokens=st.integers(0, 10),
    ),
)


async def test_fuzzed_generate_requests_get_status_codes_not_failures(mock_core, caplog):
    codes: dict[str, int] = {}
    with caplog.at_level(logging.INFO):
        async with grpc.aio.insecure_channel(mock_core.address) as channel:
            stub = spb_grpc.GenerateServiceStub(channel)
            for request in _draw(GENERATE):
                request.stopping.max_new_tokens = (
                    min(request.stopping.max_new_tokens, 8) or request.stopping.max_new_tokens
                )
                try:
                    async for _ in stub.Generate(request, timeout=30):
                        pass
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                codes[code.name] = codes.get(code.name, 0) + 1
                assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), request
    assert sum(codes.values()) == CASES
    assert not tracebacks(caplog), "a traceback was logged"
