"""Tables for the helpers every gateway shares (gateways/common): JSON type names and field paths
for error messages, compact JSON, the errors of sequences the core cut short, finish words, the
headers of streamed responses, and the fan-in of ready items."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import BaseModel, ValidationError
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common.core_call import incomplete_stream
from gateways.common.framing import dump_bytes, dumps, jsonline, loads, sse_event
from gateways.common.schema import Int32, field_path, json_type
from gateways.common.status import GatewayError
from gateways.common.streaming import FanIn, finish_word, sequence_error, stream_response


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (None, "null"),
        (True, "a boolean"),
        (3, "a number"),
        (2.5, "a number"),
        ("x", "a string"),
        ([1], "an array"),
        ({"a": 1}, "an object"),
    ],
)
def test_json_type(value, name):
    assert json_type(value) == name


@pytest.mark.parametrize(
    ("loc", "tags", "path"),
    [
        (("prompts", 2, "request_id"), (), "prompts[2].request_id"),
        (("parameters", "stop_sequences", "list[str]", 1), (), "parameters.stop_sequences[1]"),
        (("parameters", "stop", "bool"), (), "parameters.stop"),
        (("inputs", "str"), (), "inputs"),
        (
            ("messages", 0, "content", "list[tagged-union[TextPart,ImagePart]]", 1, "text", "text"),
            ("text",),
            "messages[0].content[1].text",
        ),
        (("messages", 0, "content", "str"), ("text",), "messages[0].content"),
        (("seed", "function-after[check(), int]"), (), "seed"),
        (("generation_config", "top_k"), (), "generation_config.top_k"),
    ],
)
def test_field_path(loc, tags, path):
    assert field_path(loc, tags=tags) == path


class _Given(BaseModel):
    top_k: Int32 | None = None


def test_int32_is_the_proto_range():
    _Given(top_k=2**31 - 1)
    with pytest.raises(ValidationError):
        _Given(top_k=2**31)


@pytest.mark.parametrize(
    "obj", [{"a": "ünïcode ☃", "b": [1, 2.5, None, True]}, [], "x", {"n": {"k": -1e-7, "s": 2**64 - 1}}]
)
def test_dumps_is_compact_json_that_keeps_non_ascii(obj):
    text = dumps(obj)
    assert json.loads(text) == obj
    assert text == json.dumps(obj, ensure_ascii=False, separators=(",", ":")).replace("e-07", "e-7")
    assert dump_bytes(obj) == text.encode()
    assert sse_event(obj) == b"data: " + text.encode() + b"\n\n"
    assert jsonline(obj) == text.encode() + b"\n"


def test_dumps_writes_integer_keys_as_strings_and_non_finite_floats_as_null():
    assert dumps({1: float("nan"), "b": [float("-inf"), float("inf")]}) == '{"1":null,"b":[null,null]}'


@pytest.mark.parametrize(
    ("finish", "code"),
    [
        (pb.FINISH_REASON_CANCELLED, grpc.StatusCode.UNAVAILABLE),
        (pb.FINISH_REASON_ERROR, grpc.StatusCode.INTERNAL),
        (pb.FINISH_REASON_LENGTH, None),
        (pb.FINISH_REASON_EOS, None),
        (pb.FINISH_REASON_STOP_SEQUENCE, None),
        (pb.FINISH_REASON_TIME_LIMIT, None),
    ],
)
def test_sequence_error(finish, code):
    err = sequence_error(finish)
    assert (err.code if err else None) is code


WORDS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "eos_token"}


@pytest.mark.parametrize(
    ("finish", "word", "code"),
    [
        (pb.FINISH_REASON_UNSPECIFIED, None, None),
        (pb.FINISH_REASON_LENGTH, "length", None),
        (pb.FINISH_REASON_EOS, "eos_token", None),
        (pb.FINISH_REASON_CANCELLED, None, grpc.StatusCode.UNAVAILABLE),
        (pb.FINISH_REASON_ERROR, None, grpc.StatusCode.INTERNAL),
        (pb.FINISH_REASON_STOP_SEQUENCE, None, grpc.StatusCode.INTERNAL),
    ],
)
def test_finish_word_is_the_schemas_word_or_an_error(finish, word, code):
    if code is None:
        assert finish_word(finish, WORDS) == word
    else:
        with pytest.raises(GatewayError) as info:
            finish_word(finish, WORDS)
        assert info.value.code is code


async def test_fan_in_batches_everything_ready_in_order():
    fan_in: FanIn[int] = FanIn()
    for i in range(3):
        fan_in.put_nowait(i)
    assert await fan_in.batch() == [0, 1, 2]
    fan_in.put_nowait(3)
    assert await fan_in.batch() == [3]


def test_incomplete_stream_is_internal():
    err = incomplete_stream()
    assert (err.code, err.http_status(), err.reason) == (grpc.StatusCode.INTERNAL, 500, "INCOMPLETE_STREAM")


def test_streamed_responses_are_neither_cached_nor_buffered():
    resp = stream_response("text/event-stream", charset="utf-8", headers={"x-request-id": "r1"})
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert (resp.headers["Cache-Control"], resp.headers["X-Accel-Buffering"]) == ("no-cache", "no")
    assert resp.headers["x-request-id"] == "r1"


# ------------------------------------------------------------------------- strict JSON in


def test_loads_refuses_nesting_past_the_limit_naming_where():
    deep = '{"a": [[[[1]]]]}'
    with pytest.raises(GatewayError) as e:
        loads(deep, max_depth=3)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "deeper than 3 levels" in e.value.message and "a[0][0]" in e.value.message
    assert loads(deep, max_depth=5) == {"a": [[[[1]]]]}


def test_loads_takes_many_shallow_brackets_under_a_small_limit():
    """More brackets than the limit, none deeper than it: the walk runs and accepts."""
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 20})
    assert loads(body, max_depth=5)["messages"][19]["content"][0]["text"] == "x"


@pytest.mark.parametrize("escape", ["\\ud800", "\\uDFFF", "\\uDb00"])
def test_loads_refuses_a_lone_surrogate_escape_in_any_case(escape):
    with pytest.raises(GatewayError) as e:
        loads('{"messages": [{"content": "a' + escape + 'b"}]}')
    assert "lone surrogate" in e.value.message and e.value.param == "messages[0].content"


def test_loads_refuses_a_lone_surrogate_in_text_given_as_str():
    """Text decoded elsewhere may hold the surrogate itself rather than its escape."""
    with pytest.raises(GatewayError) as e:
        loads('{"messages": [{"content": "a\ud800b"}]}')
    assert "lone surrogate" in e.value.message and e.value.param == "messages[0].content"


def test_loads_takes_a_surrogate_pair_and_refuses_nan():
    assert loads('{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}
    with pytest.raises(GatewayError, match="NaN is not a valid JSON value"):
        loads('{"t": NaN}')
