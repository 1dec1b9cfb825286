"""LMI request shapes: what parses, and the 424 payload errors (seed "Error Responses")."""

from __future__ import annotations

import pytest

from gateways.lmi.errors import MALFORMED_PAYLOAD, PayloadError
from gateways.lmi.schema import GenerationParameters, is_chat_request, parse_dynamic, parse_rolling

# What the text-generation 0.7.0 client posts (Request(...).dict()), TGI-compat mode.
TGI_CLIENT_BODY = {
    "inputs": "hi",
    "parameters": {
        "best_of": None,
        "details": True,
        "do_sample": False,
        "max_new_tokens": 20,
        "repetition_penalty": None,
        "frequency_penalty": None,
        "return_full_text": False,
        "seed": None,
        "stop": [],
        "temperature": None,
        "top_k": None,
        "top_p": None,
        "truncate": None,
        "typical_p": None,
        "watermark": False,
        "decoder_input_details": False,
        "top_n_tokens": None,
        "grammar": None,
    },
    "stream": False,
}


@pytest.mark.parametrize(
    "body",
    [
        {"inputs": "What is Deep Learning?"},
        {"inputs": "x", "parameters": None},
        {"inputs": "x", "parameters": {}, "stream": True},
        {"inputs": "x", "parameters": {"stop_sequences": "one"}},
        {"inputs": "x", "parameters": {"stop": True}},
        {"inputs": "x", "parameters": {"temperature": 1}},  # an integer is a valid float
        {"inputs": "x", "parameters": {"top_k": -1, "seed": 2**63 - 1}},
        TGI_CLIENT_BODY,
    ],
)
def test_rolling_accepts(body):
    req = parse_rolling(body)
    assert req.inputs == body["inputs"]
    assert isinstance(req.parameters, GenerationParameters)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ([{"inputs": "x"}], None, "must be a JSON object, got an array"),
        ("text", None, "got a string"),
        ({"parameters": {}}, "inputs", "no 'inputs' field"),
        ({"inputs": ["a", "b"]}, "inputs", "--batching dynamic"),
        ({"inputs": 3}, "inputs", "valid string"),
        ({"inputs": "x", "stream": "yes"}, "stream", "valid boolean"),
        ({"inputs": "x", "parameters": []}, "parameters", "GenerationParameters"),
        ({"inputs": "x", "parameters": {"max_new_tokens": "5"}}, "parameters.max_new_tokens", "valid integer"),
        ({"inputs": "x", "parameters": {"max_new_tokens": 5.0}}, "parameters.max_new_tokens", "valid integer"),
        ({"inputs": "x", "parameters": {"do_sample": 1}}, "parameters.do_sample", "valid boolean"),
        ({"inputs": "x", "parameters": {"temperature": True}}, "parameters.temperature", "valid number"),
        ({"inputs": "x", "parameters": {"top_k": 2**31}}, "parameters.top_k", "less than or equal"),
        ({"inputs": "x", "parameters": {"stop_sequences": ["a", 1]}}, "parameters.stop_sequences[1]", "valid string"),
        ({"inputs": "x", "parameters": {"stop_token_ids": ["2"]}}, "parameters.stop_token_ids[0]", "valid integer"),
        ({"inputs": "x", "parameters": {"logprobs": True}}, "parameters.logprobs", "valid integer"),
        ({"inputs": "x", "parameters": {"no_such_knob": 1}}, "parameters.no_such_knob", "not a known generation"),
        ({"inputs": "x", "adapters": 3}, "adapters", "string"),
    ],
)
def test_rolling_payload_errors(body, param, fragment):
    with pytest.raises(PayloadError) as e:
        parse_rolling(body)
    assert e.value.reason == MALFORMED_PAYLOAD
    assert e.value.param == param
    assert fragment in e.value.message


@pytest.mark.parametrize(
    ("body", "inputs", "stream"),
    [
        ({"inputs": "one"}, "one", None),
        ({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 3}}, ["a", "b"], None),
        ({"inputs": ["a"], "stream": False}, ["a"], False),
    ],
)
def test_dynamic_accepts(body, inputs, stream):
    req = parse_dynamic(body)
    assert req.inputs == inputs
    assert req.stream is stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"inputs": []}, "inputs"),
        ({"inputs": ["a", 2]}, "inputs[1]"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "a", "parameters": {"top_p": "high"}}, "parameters.top_p"),
    ],
)
def test_dynamic_payload_errors(body, param):
    with pytest.raises(PayloadError) as e:
        parse_dynamic(body)
    assert e.value.param == param


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, True),
        ({"inputs": "hi"}, False),
        ([{"messages": []}], False),
    ],
)
def test_is_chat_request(body, chat):
    assert is_chat_request(body) is chat
