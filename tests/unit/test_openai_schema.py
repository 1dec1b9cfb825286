"""Shape and type checks of chat completion bodies (gateways/common/chat/schema.py)."""

from __future__ import annotations

import grpc
import pytest

from gateways.common.chat.schema import ImagePart, TextPart, parse_chat_request
from gateways.common.status import GatewayError

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def body(**fields):
    return {"messages": USER, **fields}


ACCEPTED = [
    ("minimal", body(), {}),
    (
        "seed_request",
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is deep learning?"},
            ],
            "logprobs": True,
            "top_logprobs": 1,
            "max_tokens": 256,
        },
        {"logprobs": True, "top_logprobs": 1, "max_tokens": 256},
    ),
    (
        "every_seed_field",
        body(
            model="tiny",
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            logit_bias={"2435": -100.0, "640": 100},
            logprobs=True,
            top_logprobs=3,
            max_tokens=7,
            n=2,
            seed=-5,
            stop=["a", "b"],
            stream=True,
            temperature=0,
            top_p=0.9,
            user="test",
            ignore_eos=True,
        ),
        {"temperature": 0.0, "n": 2, "seed": -5, "stop": ["a", "b"], "user": "test"},
    ),
    ("int_for_float", body(temperature=1, top_p=1), {"temperature": 1.0, "top_p": 1.0}),
    ("stop_string", body(stop="END"), {"stop": "END"}),
    # The bound on stop strings is the core's (--max-stop-sequences), not OpenAI's 4.
    ("stop_five", body(stop=["a", "b", "c", "d", "e"]), {"stop": ["a", "b", "c", "d", "e"]}),
    ("max_completion_tokens", body(max_completion_tokens=3), {"max_completion_tokens": 3}),
    ("include_usage", body(stream=True, stream_options={"include_usage": True}), {"stream": True}),
    ("temperature_bounds", body(temperature=2.0), {"temperature": 2.0}),
    ("int64_seed", body(seed=2**63 - 1), {"seed": 2**63 - 1}),
    ("ignored_fields", body(metadata={"a": "b"}, store=False, service_tier="auto", parallel_tool_calls=True), {}),
    (
        "neutral_unsupported",
        body(tools=[], tool_choice="none", response_format={"type": "text"}, modalities=["text"], functions=None),
        {},
    ),
    (
        "tools_and_structured_output",
        body(
            tools=[TOOL],
            tool_choice="auto",
            parallel_tool_calls=False,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True}},
        ),
        {},
    ),
    (
        "echoed_assistant_message",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "hello",
                    "refusal": None,
                    "tool_calls": None,
                    "function_call": None,
                    "audio": None,
                    "annotations": [],
                },
                {"role": "user", "content": "more"},
            ]
        },
        {},
    ),
    ("assistant_null_content", {"messages": [{"role": "assistant", "content": None}]}, {}),
    ("developer_role", {"messages": [{"role": "developer", "content": "be brief"}]}, {}),
    ("named_message", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, {}),
    ("empty_messages", {"messages": []}, {}),  # a value rule: the core answers it
]


@pytest.mark.parametrize("raw, expected", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_bodies(raw, expected):
    req = parse_chat_request(raw)
    for name, value in expected.items():
        assert getattr(req, name) == value


def test_content_parts_are_typed():
    req = parse_chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                    ],
                }
            ]
        }
    )
    text, image = req.messages[0].content
    assert isinstance(text, TextPart) and text.text == "what is this?"
    assert isinstance(image, ImagePart) and image.image_url.url.startswith("data:") and image.image_url.detail == "low"


REFUSED = [
    # (id, body, param, reason)
    ("not_an_object", ["messages"], None, "INVALID_ARGUMENT"),
    ("missing_messages", {"model": "tiny"}, "messages", "INVALID_ARGUMENT"),
    ("messages_not_a_list", {"messages": "hi"}, "messages", "INVALID_ARGUMENT"),
    ("message_without_role", {"messages": [{"content": "x"}]}, "messages[0].role", "INVALID_ARGUMENT"),
    ("function_role", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "INVALID_ARGUMENT"),
    ("content_number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "INVALID_ARGUMENT"),
    (
        "part_without_type",
        {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
        "messages[0].content[0]",
        "INVALID_ARGUMENT",
    ),
    (
        "audio_part",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0]",
        "INVALID_ARGUMENT",
    ),
    (
        "text_part_number",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "INVALID_ARGUMENT",
    ),
    (
        "image_url_not_object",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages[0].content[0].image_url",
        "INVALID_ARGUMENT",
    ),
    (
        "image_detail",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "ultra"}}]}
            ]
        },
        "messages[0].content[0].image_url.detail",
        "INVALID_ARGUMENT",
    ),
    (
        "unknown_message_field",
        {"messages": [{"role": "user", "content": "x", "weight": 1}]},
        "messages[0].weight",
        "UNKNOWN_PARAMETER",
    ),
    (
        "assistant_tool_calls",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls[0].function",
        "INVALID_ARGUMENT",
    ),
    ("temperature_string", body(temperature="0.5"), "temperature", "INVALID_ARGUMENT"),
    ("temperature_above_2", body(temperature=2.5), "temperature", "INVALID_ARGUMENT"),
    ("temperature_negative", body(temperature=-0.1), "temperature", "INVALID_ARGUMENT"),
    ("top_p_bool", body(top_p=True), "top_p", "INVALID_ARGUMENT"),
    ("penalty_string", body(presence_penalty="high"), "presence_penalty", "INVALID_ARGUMENT"),
    ("logprobs_int", body(logprobs=1), "logprobs", "INVALID_ARGUMENT"),
    ("top_logprobs_float", body(top_logprobs=1.5), "top_logprobs", "INVALID_ARGUMENT"),
    ("max_tokens_string", body(max_tokens="10"), "max_tokens", "INVALID_ARGUMENT"),
    ("max_tokens_beyond_int32", body(max_tokens=2**31), "max_tokens", "INVALID_ARGUMENT"),
    ("max_completion_tokens_float", body(max_completion_tokens=1.0), "max_completion_tokens", "INVALID_ARGUMENT"),
    ("n_string", body(n="2"), "n", "INVALID_ARGUMENT"),
    ("seed_beyond_int64", body(seed=2**63), "seed", "INVALID_ARGUMENT"),
    ("seed_float", body(seed=1.5), "seed", "INVALID_ARGUMENT"),
    ("stop_number", body(stop=5), "stop", "INVALID_ARGUMENT"),
    ("stop_list_with_number", body(stop=["a", 5]), "stop[1]", "INVALID_ARGUMENT"),
    ("stream_string", body(stream="yes"), "stream", "INVALID_ARGUMENT"),
    (
        "stream_options_without_stream",
        body(stream_options={"include_usage": True}),
        "stream_options",
        "INVALID_ARGUMENT",
    ),
    (
        "stream_options_unknown",
        body(stream=True, stream_options={"continuous_usage": True}),
        "stream_options.continuous_usage",
        "UNKNOWN_PARAMETER",
    ),
    (
        "include_usage_string",
        body(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        "INVALID_ARGUMENT",
    ),
    ("logit_bias_key", body(logit_bias={"hello": 1}), "logit_bias", "INVALID_ARGUMENT"),
    ("logit_bias_key_float", body(logit_bias={"1.5": 1}), "logit_bias", "INVALID_ARGUMENT"),
    ("logit_bias_key_underscore", body(logit_bias={"1_000": 1}), "logit_bias", "INVALID_ARGUMENT"),
    ("logit_bias_key_beyond_int32", body(logit_bias={str(2**31): 1}), "logit_bias", "INVALID_ARGUMENT"),
    ("logit_bias_value", body(logit_bias={"1": "x"}), "logit_bias", "INVALID_ARGUMENT"),
    ("logit_bias_list", body(logit_bias=[1, 2]), "logit_bias", "INVALID_ARGUMENT"),
    ("user_number", body(user=5), "user", "INVALID_ARGUMENT"),
    ("ignore_eos_string", body(ignore_eos="true"), "ignore_eos", "INVALID_ARGUMENT"),
    ("model_number", body(model=1), "model", "INVALID_ARGUMENT"),
    ("unknown_field", body(foo=1), "foo", "UNKNOWN_PARAMETER"),
    ("best_of", body(best_of=2), "best_of", "UNKNOWN_PARAMETER"),
    ("functions", body(functions=[{"name": "f"}]), "functions", "UNSUPPORTED_PARAMETER"),
    ("tool_choice_without_tools", body(tool_choice="required"), "tool_choice", "INVALID_ARGUMENT"),
    (
        "tool_choice_unknown_name",
        body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
        "INVALID_ARGUMENT",
    ),
    (
        "tool_bad_name",
        body(tools=[{"type": "function", "function": {"name": "a b"}}]),
        "tools[0].function.name",
        "INVALID_ARGUMENT",
    ),
    (
        "tool_parameters_not_object",
        body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
        "INVALID_ARGUMENT",
    ),
    ("response_format_xml", body(response_format={"type": "xml"}), "response_format", "INVALID_ARGUMENT"),
    (
        "response_format_bad_name",
        body(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
        "response_format.json_schema.name",
        "INVALID_ARGUMENT",
    ),
    (
        "forced_call_and_response_format",
        body(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
        "INVALID_ARGUMENT",
    ),
    ("audio", body(audio={"voice": "x"}), "audio", "UNSUPPORTED_PARAMETER"),
    ("modalities_audio", body(modalities=["text", "audio"]), "modalities", "UNSUPPORTED_PARAMETER"),
]


@pytest.mark.parametrize("raw, param, reason", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_bodies_name_the_field(raw, param, reason):
    with pytest.raises(GatewayError) as info:
        parse_chat_request(raw)
    err = info.value
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.http_status() == 400
    assert err.param == param
    assert err.reason == reason
    assert err.message and err.message[0].isupper()
    if param:
        assert param.split("[")[0].split(".")[0] in err.message
