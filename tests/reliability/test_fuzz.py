"""Fuzzing, short version (bounded: a few hundred cases in seconds; tests/reliability/fuzzing.py
draws them, `make soak` draws more): every answer must be a client error or a success in the
schema's shape: no 5xx, no dropped socket, no process failure, no traceback in the log."""

from __future__ import annotations

import logging

import pytest

from tests.reliability.fuzzing import fuzz_grpc, fuzz_http, fuzz_ws

pytestmark = pytest.mark.timeout(240)

CASES = 60  # per strategy


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records with a traceback logged by Trellis itself (other tests' clients may knock on
    these ports meanwhile, and aiohttp logs what they send under its own name)."""
    return [r for r in caplog.records if r.exc_info and r.name.split(".")[0] in ("core", "gateways")]


@pytest.fixture(scope="module")
async def gateways(mock_core, start_gateway):
    return {name: await start_gateway(name, core=mock_core.address) for name in ("openai", "lmi", "triton", "ws")}


async def test_fuzzed_http_bodies_get_no_5xx(gateways, caplog):
    with caplog.at_level(logging.INFO):
        figures = await fuzz_http(gateways, CASES)
    assert figures["5xx"] == 0, figures["failures"]
    assert figures["cases"] >= 4 * CASES
    assert not tracebacks(caplog), "a traceback was logged"


async def test_fuzzed_websocket_frames_never_drop_the_socket(gateways, caplog):
    with caplog.at_level(logging.INFO):
        figures = await fuzz_ws(gateways["ws"], CASES)
    assert figures["5xx"] == 0
    assert not tracebacks(caplog), "a traceback was logged"


async def test_fuzzed_generate_requests_get_status_codes_not_failures(mock_core, caplog):
    with caplog.at_level(logging.INFO):
        figures = await fuzz_grpc(mock_core.address, CASES)
    assert figures["5xx"] == 0, figures["failures"]
    assert figures["cases"] == CASES
    assert not tracebacks(caplog), "a traceback was logged"
