"""Tables for the helpers every gateway shares (gateways/common): JSON type names and field paths
for error messages, the copy of given fields onto proto messages, compact JSON, the errors of
sequences the core cut short, and the headers of streamed responses."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import BaseModel, ValidationError
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common.framing import dumps
from gateways.common.schema import Int32, copy_given, field_path, json_type
from gateways.common.streaming import incomplete_stream, sequence_error, stream_response


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
    temperature: float | None = None
    top_k: Int32 | None = None
    ignore_eos_token: bool | None = None


def test_copy_given_sets_only_what_the_client_gave():
    sampling = pb.SamplingParams()
    copy_given(_Given(temperature=0.5), sampling, ("temperature", "top_k"))
    assert sampling.temperature == 0.5 and not sampling.HasField("top_k")
    stopping = pb.StoppingParams()
    copy_given(_Given(ignore_eos_token=False), stopping, {"ignore_eos_token": "ignore_eos"})
    assert stopping.HasField("ignore_eos") and stopping.ignore_eos is False


def test_int32_is_the_proto_range():
    _Given(top_k=2**31 - 1)
    with pytest.raises(ValidationError):
        _Given(top_k=2**31)


@pytest.mark.parametrize("obj", [{"a": "ünïcode ☃", "b": [1, 2.5, None, True]}, [], "x", {"nested": {"k": -1e-7}}])
def test_dumps_is_compact_json_that_keeps_non_ascii(obj):
    assert dumps(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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


def test_incomplete_stream_is_internal():
    err = incomplete_stream()
    assert (err.code, err.http_status(), err.reason) == (grpc.StatusCode.INTERNAL, 500, "INCOMPLETE_STREAM")


def test_streamed_responses_are_neither_cached_nor_buffered():
    resp = stream_response("text/event-stream", charset="utf-8", headers={"x-request-id": "r1"})
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert (resp.headers["Cache-Control"], resp.headers["X-Accel-Buffering"]) == ("no-cache", "no")
    assert resp.headers["x-request-id"] == "r1"
