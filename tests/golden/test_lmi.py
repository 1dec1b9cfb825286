"""Golden tests of the LMI gateway: every example of the seeds (`lmi-input-output-schema.md`, and
`lmi-chat-completions-schema.md` for chat bodies on /invocations), request -> expected response,
on a real core and a real gateway on loopback.

A case (`tests/golden/lmi/<name>.json`) holds the gateway options, the request (`body` as JSON or
`raw_body` as text) and the expected response: status, content type and either `body` or
`records` (the streamed jsonlines/SSE records: `all`, or `all_but_last` + `last`, optionally
`count`), in the placeholder dialect of tests/golden/harness.py. Records are a rule for every
record, not a value: TRELLIS_UPDATE_GOLDEN regenerates `body` cases only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.golden.harness import GOLDEN, cases, check, load, match

CASES = [p.stem for p in cases("lmi")]
# Cases that need a special setup and are run by tests/integration/test_gateway_lmi.py.
SPECIAL = {"error_in_stream"}

_gateways: dict[str, str] = {}


def load_case(name: str) -> dict[str, Any]:
    """One golden case by file stem."""
    return load(GOLDEN / "lmi" / f"{name}.json")


def parse_records(text: str, framing: str) -> list[Any]:
    """Records of a jsonlines body (one JSON per line) or an SSE body (`data: <json>` events
    separated by blank lines)."""
    if framing == "sse":
        events = [e for e in text.split("\n\n") if e.strip()]
        assert all(e.startswith("data: ") for e in events), text
        return [json.loads(e[len("data: ") :]) for e in events]
    assert text.endswith("\n"), "jsonlines records end with a newline"
    return [json.loads(line) for line in text.splitlines() if line]


def check_records(expected: dict[str, Any], records: list[Any]) -> None:
    """Match streamed records against a golden `records` spec, and check the rolling-batch
    invariants: one record per generated token, and the token texts add up to generated_text."""
    assert records, "the stream has no records"
    if "count" in expected:
        assert len(records) == expected["count"]
    if "all" in expected:
        for i, rec in enumerate(records):
            match(expected["all"], rec, f"records[{i}]")
        return
    for i, rec in enumerate(records[:-1]):
        match(expected["all_but_last"], rec, f"records[{i}]")
    match(expected["last"], records[-1], f"records[{len(records) - 1}]")
    last = records[-1]
    if last["token"]["id"] == -1:  # the in-band error record
        return
    texts = "".join(r["token"]["text"] for r in records)
    assert texts == last["generated_text"]
    if "details" in last:
        assert last["details"]["generated_tokens"] == len(records)


async def gateway_for(start_gateway, options: dict[str, Any]) -> str:
    """A started LMI gateway with these options (one per distinct option set)."""
    key = json.dumps(options, sort_keys=True)
    if key not in _gateways:
        _gateways[key] = await start_gateway("lmi", **options)
    return _gateways[key]


async def run_case(base: str, case: dict[str, Any], path: Path | None = None) -> None:
    """Send a case's request to the gateway at `base` and check the response (with `path`, the
    case's file: regenerated under TRELLIS_UPDATE_GOLDEN)."""
    req, want = case["request"], case["response"]
    headers = dict(req.get("headers", {}))
    if "raw_body" in req:
        data = req["raw_body"].encode()
        headers.setdefault("Content-Type", "application/json")
    else:
        data = json.dumps(req["body"]).encode()
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession() as session:
        async with session.request(req.get("method", "POST"), base + req["path"], data=data, headers=headers) as resp:
            text = await resp.text()
            status, content_type = resp.status, resp.content_type
    if "body" in want and path is not None:
        check(path, case, {"response": {"status": status, "content_type": content_type, "body": json.loads(text)}})
        return
    assert (status, content_type) == (want["status"], want["content_type"]), text
    if "body" in want:
        match(want["body"], json.loads(text))
    else:
        check_records(want["records"], parse_records(text, want["records"]["framing"]))


@pytest.mark.parametrize("name", [c for c in CASES if c not in SPECIAL])
async def test_golden(name, start_gateway):
    case = load_case(name)
    base = await gateway_for(start_gateway, case.get("gateway", {}))
    await run_case(base, case, GOLDEN / "lmi" / f"{name}.json")
