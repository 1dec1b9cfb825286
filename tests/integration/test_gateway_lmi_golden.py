"""Golden tests of the LMI gateway: every example of the seeds (`lmi-input-output-schema.md`, and
`lmi-chat-completions-schema.md` for chat bodies on /invocations), request -> expected response,
on a real core and a real gateway on loopback.

A case (`tests/golden/lmi/<name>.json`) holds the gateway options, the request (`body` as JSON or
`raw_body` as text) and the expected status, content type and either `body` or `records` (the
streamed jsonlines/SSE records: `all`, or `all_but_last` + `last`, optionally `count`).

Values random by nature are written as placeholders whose presence, type and sign are checked:
`<str>`, `<bool>`, `<int>`, `<token_id>` (int >= 0), `<logprob>` (number <= 0), `<finish_reason>`
(length, eos_token, stop_sequence; `<finish_reason|null>` also null), `<any>`. A list
`["<each:N>", T]` is N items that each match T (`<each>`: any number). A key ending in `?` may be
absent. Everything else must be equal, and objects must have exactly the expected keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "lmi"
CASES = sorted(p.stem for p in GOLDEN.glob("*.json"))
# Cases that need a special setup and are run by test_gateway_lmi.py.
SPECIAL = {"error_in_stream"}
FINISH_REASONS = {"length", "eos_token", "stop_sequence"}

_gateways: dict[str, str] = {}


def load_case(name: str) -> dict[str, Any]:
    """One golden case by file stem."""
    return json.loads((GOLDEN / f"{name}.json").read_text())


def match(expected: Any, actual: Any, path: str = "$") -> None:
    """Assert that `actual` matches the golden `expected` (module docstring)."""
    if isinstance(expected, str) and expected.startswith("<") and expected.endswith(">"):
        _match_placeholder(expected, actual, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected an object, got {actual!r}"
        required = {k for k in expected if not k.endswith("?")}
        optional = {k[:-1]: v for k, v in expected.items() if k.endswith("?")}
        missing = required - actual.keys()
        extra = actual.keys() - required - optional.keys()
        assert not missing and not extra, f"{path}: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}"
        for key, value in actual.items():
            match(expected[key] if key in expected else optional[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: expected an array, got {actual!r}"
        if expected and isinstance(expected[0], str) and expected[0].startswith("<each"):
            count = expected[0][len("<each") : -1].lstrip(":")
            if count:
                assert len(actual) == int(count), f"{path}: expected {count} items, got {len(actual)}"
            for i, item in enumerate(actual):
                match(expected[1], item, f"{path}[{i}]")
        else:
            assert len(actual) == len(expected), f"{path}: expected {len(expected)} items, got {len(actual)}"
            for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
                match(e, a, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: expected {expected!r}, got {actual!r}"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _match_placeholder(placeholder: str, actual: Any, path: str) -> None:
    checks = {
        "<any>": lambda v: True,
        "<str>": lambda v: isinstance(v, str),
        "<bool>": lambda v: isinstance(v, bool),
        "<int>": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "<token_id>": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "<logprob>": lambda v: _is_number(v) and v <= 0,
        "<finish_reason>": lambda v: v in FINISH_REASONS,
        "<finish_reason|null>": lambda v: v is None or v in FINISH_REASONS,
    }
    assert placeholder in checks, f"{path}: unknown placeholder {placeholder}"
    assert checks[placeholder](actual), f"{path}: {actual!r} does not match {placeholder}"


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


async def run_case(base: str, case: dict[str, Any]) -> None:
    """Send a case's request to the gateway at `base` and check the response."""
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
            assert resp.status == want["status"], text
            assert resp.content_type == want["content_type"]
    if "body" in want:
        match(want["body"], json.loads(text))
    else:
        check_records(want["records"], parse_records(text, want["records"]["framing"]))


@pytest.mark.parametrize("name", [c for c in CASES if c not in SPECIAL])
async def test_golden(name, start_gateway):
    case = load_case(name)
    base = await gateway_for(start_gateway, case.get("gateway", {}))
    await run_case(base, case)


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        ({"a": "<int>"}, {"a": 3}, True),
        ({"a": "<int>"}, {"a": True}, False),
        ({"a": "<logprob>"}, {"a": 0.5}, False),
        ({"a": "<logprob>"}, {"a": -0.5}, True),
        ({"a": 1, "b?": True}, {"a": 1}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        (["<each:2>", "<str>"], ["x", "y"], True),
        (["<each:2>", "<str>"], ["x"], False),
        ({"a": None}, {"a": None}, True),
        ({"a": 0}, {"a": False}, False),
    ],
)
def test_matcher(expected, actual, ok):
    if ok:
        match(expected, actual)
    else:
        with pytest.raises(AssertionError):
            match(expected, actual)
