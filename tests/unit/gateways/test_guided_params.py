"""gateways.common.guided: OpenAI's response_format as a guide (shared by every OpenAI route)."""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from pydantic import TypeAdapter

from gateways.common.guided import ResponseFormat, response_format_guide

FORMAT = TypeAdapter(ResponseFormat)


@pytest.mark.parametrize(
    ("response_format", "guide"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json_object": True}),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, {"json_object": True}),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}},
            {"json_schema": '{"type": "integer"}'},
        ),
    ],
)
def test_response_format_guides(response_format, guide):
    got = response_format_guide(FORMAT.validate_python(response_format))
    assert (json_format.MessageToDict(got, preserving_proto_field_name=True) if got is not None else None) == guide


def test_no_response_format_is_free_text():
    assert response_format_guide(None) is None
