"""schemathesis against each gateway's own `/openapi.json`: a short pass per
gateway, in-process on loopback with a mock-engine core (steps back to back). Every answer is
checked for no 5xx and for conformance to the document (status, content type, headers, body,
each SSE event's JSON); a body the document refuses must be refused. The gateway must still
answer afterwards and must have logged no traceback. The long pass is fuzz_figures.fuzz_figures
(`make soak`)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from tests.reliability.fuzz_figures import GATEWAYS, fuzz_gateway

pytestmark = pytest.mark.timeout(180)

#: Examples per operation and generation mode: about 5 s per gateway here.
MAX_EXAMPLES = 12


class _Tracebacks(logging.Handler):
    """Collects every gateway log record (gateways.*, aiohttp.*) that carries an exception."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.name.split(".")[0] in ("gateways", "aiohttp"):
            self.records.append(record)


@pytest.fixture(scope="module")
async def fuzz_core(start_mock_core):
    return await start_mock_core(mock_step_ms=0.0)


@pytest.mark.parametrize("name", GATEWAYS)
async def test_schemathesis_finds_no_5xx_no_mismatch_and_no_traceback(fuzz_core, start_gateway, name):
    base = await start_gateway(name, core=fuzz_core.address)
    tracebacks = _Tracebacks()
    logging.getLogger().addHandler(tracebacks)
    try:
        counts = await asyncio.to_thread(fuzz_gateway, base, max_examples=MAX_EXAMPLES)
    finally:
        logging.getLogger().removeHandler(tracebacks)
    assert counts.cases > 0
    assert counts.server_errors == 0
    assert counts.failures == []
    assert [r.getMessage() for r in tracebacks.records] == []
    async with aiohttp.ClientSession() as http, http.get(base + "/openapi.json") as resp:
        assert resp.status == 200  # the gateway still serves
