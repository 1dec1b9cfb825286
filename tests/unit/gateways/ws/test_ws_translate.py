"""Table tests of gateways.ws.translate: payload -> GenerateRequest (with ".env" default
precedence), Generate messages -> events, COMPLETE, and the writer's frame grouping."""

import grpc
import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError
from gateways.ws import translate
from gateways.ws.routes import _frames
from gateways.ws.schema import GenerationConfig, WsRequest

NO_DEFAULTS = GenerationConfig()
ENV = GenerationConfig(max_new_tokens=12, temperature=0.5, do_sample=True, num_beams=1)

REQUEST_CASES = [
    (
        "prompt only",
        {"prompts": [{"request_id": "a", "prompt": "Hi"}]},
        NO_DEFAULTS,
        [{"requestId": "a", "sessionId": "a", "text": "Hi"}],
    ),
    (
        "every generation_config field",
        {
            "prompts": [{"request_id": "a", "prompt": "Hi"}],
            "generation_config": {
                "num_beams": 1,
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 50,
                "max_new_tokens": 100,
                "repetition_penalty": 1.1,
                "length_penalty": 1,
            },
        },
        NO_DEFAULTS,
        [
            {
                "requestId": "a",
                "sessionId": "a",
                "text": "Hi",
                "sampling": {
                    "numBeams": 1,
                    "doSample": True,
                    "temperature": 0.7,
                    "topP": 0.9,
                    "topK": 50,
                    "repetitionPenalty": 1.1,
                    "lengthPenalty": 1.0,
                },
                "stopping": {"maxNewTokens": 100},
            }
        ],
    ),
    (
        "zero values are sent, not dropped",
        {
            "prompts": [{"request_id": "a", "prompt": "Hi"}],
            "generation_config": {"temperature": 0, "top_k": 0, "do_sample": False},
        },
        NO_DEFAULTS,
        [
            {
                "requestId": "a",
                "sessionId": "a",
                "text": "Hi",
                "sampling": {"doSample": False, "temperature": 0.0, "topK": 0},
            }
        ],
    ),
    (
        ".env defaults fill what the client left out",
        {"prompts": [{"request_id": "a", "prompt": "Hi"}]},
        ENV,
        [
            {
                "requestId": "a",
                "sessionId": "a",
                "text": "Hi",
                "sampling": {"numBeams": 1, "doSample": True, "temperature": 0.5},
                "stopping": {"maxNewTokens": 12},
            }
        ],
    ),
    (
        "the client's values win over .env",
        {
            "prompts": [{"request_id": "a", "prompt": "Hi"}],
            "generation_config": {"max_new_tokens": 3, "do_sample": False, "temperature": None},
        },
        ENV,
        [
            {
                "requestId": "a",
                "sessionId": "a",
                "text": "Hi",
                "sampling": {"numBeams": 1, "doSample": False, "temperature": 0.5},
                "stopping": {"maxNewTokens": 3},
            }
        ],
    ),
    (
        "only_new_tokens false asks for the echoed input sequence",
        {"prompts": [{"request_id": "a", "prompt": "Hi"}], "only_new_tokens": False},
        NO_DEFAULTS,
        [{"requestId": "a", "sessionId": "a", "text": "Hi", "output": {"echo": True}}],
    ),
    (
        "an empty prompt leaves the input unset (continue a session)",
        {"prompts": [{"request_id": "a", "prompt": ""}]},
        NO_DEFAULTS,
        [{"requestId": "a", "sessionId": "a"}],
    ),
    (
        "a batch: one request per prompt, same settings",
        {
            "prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "b", "prompt": "y"}],
            "generation_config": {"top_k": 3},
            "stream_response": False,
        },
        NO_DEFAULTS,
        [
            {"requestId": "a", "sessionId": "a", "text": "x", "sampling": {"topK": 3}},
            {"requestId": "b", "sessionId": "b", "text": "y", "sampling": {"topK": 3}},
        ],
    ),
]


@pytest.mark.parametrize("body, defaults, expected", [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES])
def test_to_generate_request(body, defaults, expected):
    req = WsRequest.model_validate(body)
    got = [json_format.MessageToDict(translate.to_generate_request(req, item, defaults)) for item in req.prompts]
    assert _approx(got, expected)


def _approx(got, expected):
    """Compare proto-JSON dicts, floats to float32 precision."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), (got, expected)
        return all(_approx(got[k], expected[k]) for k in expected)
    if isinstance(expected, list):
        assert len(got) == len(expected), (got, expected)
        return all(_approx(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-6), (got, expected)
        return True
    assert got == expected, (got, expected)
    return True


def _state(**kw):
    return translate.PromptState("r", **kw)


Q = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_QUEUED)
Q_ECHO = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_QUEUED, prompt_text="Hi there")
S = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_SCHEDULED)
P = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_PREFILLED)
G1 = spb.GenerateResponse(
    request_id="r", state=pb.GENERATE_STATE_GENERATING, outputs=[pb.SequenceOutput(index=0, text=" a")]
)
HELD = spb.GenerateResponse(request_id="r", outputs=[pb.SequenceOutput(index=0, text="")])
FINAL = spb.GenerateResponse(
    request_id="r",
    outputs=[pb.SequenceOutput(index=0, text=" b", finish_reason=pb.FINISH_REASON_LENGTH)],
    usage=pb.Usage(prompt_tokens=3, completion_tokens=3),
    timing=pb.Timing(total_ms=1711.0),
)
FINAL_EOS = spb.GenerateResponse(
    request_id="r",
    outputs=[pb.SequenceOutput(index=0, text="", finish_reason=pb.FINISH_REASON_EOS)],
    usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
    timing=pb.Timing(total_ms=20.0),
)

EVENT_CASES = [
    ("QUEUED -> ACCEPTED", Q, {}, [{"request_id": "r", "type": "ACCEPTED"}]),
    ("SCHEDULED -> STARTED", S, {}, [{"request_id": "r", "type": "STARTED"}]),
    (
        "PREFILLED -> INITIALIZED, empty text with only_new_tokens",
        P,
        {},
        [{"request_id": "r", "type": "INITIALIZED", "text": ""}],
    ),
    (
        "PREFILLED -> INITIALIZED with the input text",
        P,
        {"only_new_tokens": False, "input_text": "Hi there"},
        [{"request_id": "r", "type": "INITIALIZED", "text": "Hi there"}],
    ),
    ("GENERATING with a delta -> PROGRESS only", G1, {}, [{"request_id": "r", "type": "PROGRESS", "text": " a"}]),
    ("no PROGRESS without stream_response", G1, {"stream_response": False}, []),
    ("an empty (held back) delta gives no event", HELD, {}, []),
    (
        "the final message's delta is a PROGRESS; COMPLETE comes from to_complete",
        FINAL,
        {},
        [{"request_id": "r", "type": "PROGRESS", "text": " b"}],
    ),
    (
        "other sequence indexes are ignored",
        spb.GenerateResponse(outputs=[pb.SequenceOutput(index=1, text="z")]),
        {},
        [],
    ),
]


@pytest.mark.parametrize("msg, state_kw, expected", [c[1:] for c in EVENT_CASES], ids=[c[0] for c in EVENT_CASES])
def test_to_events(msg, state_kw, expected):
    assert translate.to_events(msg, _state(**state_kw)) == expected


def test_echoed_prompt_text_is_kept_for_initialized():
    state = _state(only_new_tokens=False)
    translate.to_events(Q_ECHO, state)
    assert state.input_text == "Hi there"
    assert translate.to_events(P, state) == [{"request_id": "r", "type": "INITIALIZED", "text": "Hi there"}]


COMPLETE_CASES = [
    (
        "only new tokens",
        {},
        [Q, S, P, G1, HELD, FINAL],
        {
            "request_id": "r",
            "type": "COMPLETE",
            "text": " a b",
            "is_eos": False,
            "new_tokens_count": 3,
            "execution_time": 1.711,
        },
    ),
    (
        "with the input sequence in front",
        {"only_new_tokens": False},
        [Q_ECHO, S, P, G1, FINAL],
        {
            "request_id": "r",
            "type": "COMPLETE",
            "text": "Hi there a b",
            "is_eos": False,
            "new_tokens_count": 3,
            "execution_time": 1.711,
        },
    ),
    (
        "EOS, without streaming",
        {"stream_response": False},
        [Q, S, P, G1, FINAL_EOS],
        {
            "request_id": "r",
            "type": "COMPLETE",
            "text": " a",
            "is_eos": True,
            "new_tokens_count": 2,
            "execution_time": 0.02,
        },
    ),
]


@pytest.mark.parametrize(
    "state_kw, msgs, expected", [c[1:] for c in COMPLETE_CASES], ids=[c[0] for c in COMPLETE_CASES]
)
def test_to_complete(state_kw, msgs, expected):
    state = _state(**state_kw)
    for m in msgs:
        translate.to_events(m, state)
    assert translate.to_complete(state) == expected


@pytest.mark.parametrize(
    "finish, code",
    [(pb.FINISH_REASON_CANCELLED, grpc.StatusCode.UNAVAILABLE), (pb.FINISH_REASON_ERROR, grpc.StatusCode.INTERNAL)],
)
def test_a_sequence_the_core_cut_short_is_an_error_not_a_complete(finish, code):
    state = _state()
    cut = spb.GenerateResponse(request_id="r", outputs=[pb.SequenceOutput(index=0, text="x", finish_reason=finish)])
    with pytest.raises(GatewayError) as info:
        translate.to_events(cut, state)
    assert info.value.code is code


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, ENV.model_dump()),
        (GenerationConfig(), ENV.model_dump()),
        (GenerationConfig(max_new_tokens=1, top_k=2), {**ENV.model_dump(), "max_new_tokens": 1, "top_k": 2}),
    ],
    ids=["absent", "empty", "partial"],
)
def test_effective_config(given, expected):
    assert dict(translate.effective_config(given, ENV)) == expected


E1, E2, E3 = ({"request_id": str(i), "type": "PROGRESS", "text": "x"} for i in range(3))
ERR = [{"error": "bad"}]


@pytest.mark.parametrize(
    "items, frames",
    [
        ([E1], [[E1]]),
        ([E1, E2, E3], [[E1, E2, E3]]),
        ([ERR], [ERR]),
        ([E1, ERR, E2, E3], [[E1], ERR, [E2, E3]]),
        ([ERR, ERR], [ERR, ERR]),
    ],
    ids=["one", "ready events share a frame", "error alone", "error splits events", "errors stay apart"],
)
def test_frames(items, frames):
    assert _frames(items) == frames
