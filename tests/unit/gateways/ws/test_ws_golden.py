"""Golden round trips of the /ws protocol (tests/golden/ws/*.json), starting from the seed's
examples: a frame -> the GenerateRequests the gateway sends, and scripted Generate streams (or
failures) -> the events the client receives, in order.

Each file holds `payload`, `defaults` (".env" values), the expected `requests` (proto-JSON),
per request_id a `stream` (`messages` in proto-JSON and an optional `error`: code, message,
param) and the expected `events`. Set TRELLIS_UPDATE_GOLDEN=1 to rewrite `requests` and
`events` from the current code (then review the diff).
"""

import json
import os
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError
from gateways.ws import errors, translate
from gateways.ws.schema import GenerationConfig, parse_frame

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "ws"
CASES = sorted(GOLDEN.glob("*.json"))
UPDATE = os.environ.get("TRELLIS_UPDATE_GOLDEN") == "1"


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


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden(path):
    case = json.loads(path.read_text())
    body = parse_frame(json.dumps(case["payload"]), max_prompts=64)
    defaults = GenerationConfig.model_validate(case.get("defaults", {}))
    requests = [json_format.MessageToDict(translate.to_generate_request(body, item, defaults)) for item in body.prompts]
    events = {item.request_id: _events(item, body, case["streams"][item.request_id]) for item in body.prompts}
    if UPDATE:
        case["requests"], case["events"] = requests, events
        path.write_text(json.dumps(case, indent=2, ensure_ascii=False) + "\n")
    assert requests == case["requests"]
    assert events == case["events"]


def test_golden_cases_exist():
    assert {p.stem for p in CASES} >= {"seed_example", "seed_error_num_beams"}
