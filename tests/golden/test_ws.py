"""Golden round trips of the /ws protocol (tests/golden/ws/*.json), starting from the seed's
examples: a frame -> the GenerateRequests the gateway sends, and scripted Generate streams (or
failures) -> the events the client receives, in order.

Each file holds `payload`, `defaults` (".env" values), the expected `requests` (proto-JSON),
per request_id a `stream` (`messages` in proto-JSON and an optional `error`: code, message,
param) and the expected `events`, checked with the harness of tests/golden/harness.py.
"""

import json

import grpc
import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError
from gateways.ws import errors, translate
from gateways.ws.schema import GenerationConfig, parse_frame
from tests.golden.harness import cases, check, load

CASES = cases("ws")


def _events(item, body, stream) -> list[dict]:
    state = translate.PromptState.start(body, item)
    events: list[dict] = []
    for raw in stream.get("messages", []):
        events += translate.to_events(json_format.ParseDict(raw, spb.GenerateResponse()), state)
    error = stream.get("error")
    if error is not None:
        err = GatewayError(
            grpc.StatusCode[error["code"]], error["message"], param=error.get("param"), reason=error.get("reason")
        )
        events.append(errors.render_in_stream(err, item.request_id, prompt=item.prompt))
    else:
        events.append(translate.to_complete(state))
    return events


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_golden(path):
    case = load(path)
    body = parse_frame(json.dumps(case["payload"]), max_prompts=64)
    defaults = GenerationConfig.model_validate(case.get("defaults", {}))
    requests = [json_format.MessageToDict(translate.to_generate_request(body, item, defaults)) for item in body.prompts]
    events = {item.request_id: _events(item, body, case["streams"][item.request_id]) for item in body.prompts}
    check(path, case, {"requests": requests, "events": events})


def test_golden_cases_exist():
    assert {p.stem for p in CASES} >= {"seed_example", "seed_error_num_beams"}
