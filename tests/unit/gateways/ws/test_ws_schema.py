"""Shape and type checks of /ws frames (gateways.ws.schema.parse_frame): accepted frames and
every refusal, each naming the offending field."""

import json

import grpc
import pytest

from gateways.common.status import GatewayError
from gateways.ws.schema import WsRequest, field_path, parse_frame

ONE = {"request_id": "a", "prompt": "Hello"}

VALID = [
    ({"prompts": [ONE]}, dict(only_new_tokens=True, streaming=True, config=None)),
    (
        {"prompts": [ONE], "only_new_tokens": False, "stream_response": False, "generation_config": {"top_k": 5}},
        dict(only_new_tokens=False, streaming=False, config={"top_k": 5}),
    ),
    (
        {"prompts": [ONE], "only_new_tokens": None, "stream_response": None, "generation_config": None},
        dict(only_new_tokens=True, streaming=True, config=None),
    ),
    # The seed's example payload; JSON integers are accepted for float fields.
    (
        {
            "prompts": [{"request_id": "2835f3c5", "prompt": "[INST] Generate a very long poem [/INST]\n\n"}],
            "only_new_tokens": True,
            "stream_response": True,
            "generation_config": {
                "num_beams": 1,
                "do_sample": True,
                "temperature": 1,
                "top_p": 1,
                "top_k": 50,
                "max_new_tokens": 100,
                "repetition_penalty": 1,
                "length_penalty": 1,
            },
        },
        dict(
            only_new_tokens=True,
            streaming=True,
            config={
                "num_beams": 1,
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 50,
                "max_new_tokens": 100,
                "repetition_penalty": 1.0,
                "length_penalty": 1.0,
            },
        ),
    ),
    ({"prompts": [{"request_id": "a", "prompt": ""}]}, dict(only_new_tokens=True, streaming=True, config=None)),
    (
        {"prompts": [ONE], "generation_config": {"temperature": None, "max_new_tokens": 7}},
        dict(only_new_tokens=True, streaming=True, config={"max_new_tokens": 7}),
    ),
]


@pytest.mark.parametrize("body, expected", VALID, ids=[f"valid{i}" for i in range(len(VALID))])
def test_valid_frames(body, expected):
    req = parse_frame(json.dumps(body), max_prompts=8)
    assert isinstance(req, WsRequest)
    assert req.new_tokens_only is expected["only_new_tokens"]
    assert req.streaming is expected["streaming"]
    cfg = None if req.generation_config is None else req.generation_config.model_dump(exclude_none=True)
    assert cfg == expected["config"]
    assert [p.request_id for p in req.prompts] == [p["request_id"] for p in body["prompts"]]


INVALID = [
    ("not json", "The frame is not valid JSON", None),
    ("[1, 2]", "The frame must be a JSON object with a 'prompts' array.", None),
    ('"text"', "The frame must be a JSON object with a 'prompts' array.", None),
    ("{}", "prompts: is required.", "prompts"),
    ('{"prompts": []}', "prompts: must not be empty.", "prompts"),
    ('{"prompts": {"request_id": "a", "prompt": "x"}}', "prompts: must be an array.", "prompts"),
    ('{"prompts": ["x"]}', "prompts[0]: must be an object.", "prompts[0]"),
    ('{"prompts": [{"prompt": "x"}]}', "prompts[0].request_id: is required.", "prompts[0].request_id"),
    (
        '{"prompts": [{"request_id": "", "prompt": "x"}]}',
        "prompts[0].request_id: must not be empty.",
        "prompts[0].request_id",
    ),
    (
        '{"prompts": [{"request_id": 7, "prompt": "x"}]}',
        "prompts[0].request_id: must be a string.",
        "prompts[0].request_id",
    ),
    ('{"prompts": [{"request_id": "a"}]}', "prompts[0].prompt: is required.", "prompts[0].prompt"),
    (
        '{"prompts": [{"request_id": "a", "prompt": ["x"]}]}',
        "prompts[0].prompt: must be a string.",
        "prompts[0].prompt",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x", "extra": 1}]}',
        "prompts[0].extra: is not a field of this protocol.",
        "prompts[0].extra",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}, {"request_id": "a", "prompt": "y"}]}',
        "prompts[1].request_id: 'a' appears more than once in the batch",
        "prompts[1].request_id",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "only_new_tokens": "yes"}',
        "only_new_tokens: must be true or false.",
        "only_new_tokens",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "stream_response": 1}',
        "stream_response: must be true or false.",
        "stream_response",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": []}',
        "generation_config: must be an object.",
        "generation_config",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"temperature": "hot"}}',
        "generation_config.temperature: must be a number.",
        "generation_config.temperature",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"top_k": 1.5}}',
        "generation_config.top_k: must be an integer.",
        "generation_config.top_k",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"max_new_tokens": true}}',
        "generation_config.max_new_tokens: must be an integer.",
        "generation_config.max_new_tokens",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"num_beams": 4294967296}}',
        "generation_config.num_beams: must fit in a 32-bit signed integer.",
        "generation_config.num_beams",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"do_sample": "true"}}',
        "generation_config.do_sample: must be true or false.",
        "generation_config.do_sample",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"seed": 3}}',
        "generation_config.seed: is not a field of this protocol.",
        "generation_config.seed",
    ),
    (
        '{"prompts": [{"request_id": "a", "prompt": "x"}], "stop": ["\\n"]}',
        "stop: is not a field of this protocol.",
        "stop",
    ),
    (
        json.dumps({"prompts": [{"request_id": str(i), "prompt": "x"} for i in range(9)]}),
        "prompts: the batch has 9 prompts; at most 8 are accepted per frame.",
        "prompts",
    ),
]


@pytest.mark.parametrize("frame, message, param", INVALID, ids=[f"invalid{i}" for i in range(len(INVALID))])
def test_invalid_frames(frame, message, param):
    with pytest.raises(GatewayError) as info:
        parse_frame(frame, max_prompts=8)
    err = info.value
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.message.startswith(message)
    assert err.param == param


@pytest.mark.parametrize(
    "loc, path",
    [
        ((), ""),
        (("prompts",), "prompts"),
        (("prompts", 2, "request_id"), "prompts[2].request_id"),
        (("generation_config", "top_k"), "generation_config.top_k"),
    ],
)
def test_field_path(loc, path):
    assert field_path(loc) == path
