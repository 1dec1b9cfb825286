"""Golden cases of the chat completions translation from the seed's examples
(tests/golden/openai/*.json), checked with the harness of tests/golden/harness.py.

Each file holds one case: `kind` "request" (body -> GenerateRequest), "completion" (scripted
Generate stream -> chat.completion), "stream" (scripted stream -> chunks and wire bytes) or
"error" (refused body -> status and error object). Inputs and expected GenerateRequests are
proto-JSON. `finish_reasons` names the table: "openai", or "lmi" (the LMI gateway's, for chat
on /invocations).
"""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import errors, route, translate
from gateways.common.chat.schema import parse_chat_request
from gateways.common.status import GatewayError
from gateways.lmi.translate import FINISH_REASONS as LMI_FINISH_REASONS
from tests.golden.harness import cases, check, load

CASES = cases("openai")


def _stream(case) -> list[spb.GenerateResponse]:
    return [json_format.ParseDict(m, spb.GenerateResponse()) for m in case["stream"]]


def _state(case) -> translate.StreamState:
    return translate.state_for(
        parse_chat_request(case["body"]),
        completion_id=case["completion_id"],
        created=case["created"],
        model=case["model"],
        finish_words=LMI_FINISH_REASONS if case["finish_reasons"] == "lmi" else translate.FINISH_REASONS,
    )


def _run(case) -> dict:
    kind = case["kind"]
    if kind == "request":
        req = translate.to_generate_request(parse_chat_request(case["body"]), request_id=case["request_id"])
        return {"expected": json_format.MessageToDict(req, preserving_proto_field_name=True)}
    if kind == "completion":
        return {"expected": translate.to_completion(_stream(case), _state(case))}
    if kind == "stream":
        state = _state(case)
        chunks = [c for m in _stream(case) for c in translate.to_chunks(m, state)]
        if state.include_usage:
            chunks.append(translate.usage_chunk(state))
        framing = case["framing"]
        wire = (route.encode(chunks, framing) + route.end_of_stream(framing)).decode()
        return {"expected": chunks, "expected_wire": wire}
    if kind == "error":
        with pytest.raises(GatewayError) as info:
            parse_chat_request(case["body"])
        resp = errors.render_before_stream(info.value)
        return {"expected": {"status": resp.status, "body": json.loads(resp.body)}}
    raise AssertionError(f"unknown golden kind {kind!r}")


def test_golden_files_exist():
    assert {load(p)["kind"] for p in CASES} == {"request", "completion", "stream", "error"}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_golden(path):
    case = load(path)
    check(path, case, _run(case))
