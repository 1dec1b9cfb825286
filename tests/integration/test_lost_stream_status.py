"""A MultiplexGenerate stream whose status grpc lost: grpc.aio reads INTERNAL "Internal error
from Core" (`_AioCall.set_internal_error`, grpc 1.85) instead of the server's own status when
the server ended the stream while the client was writing to it. Against a core without
MultiplexGenerate that happens to about 1 in 100 first streams, so the gateway would fail a
request instead of falling back to Generate. The gateway resends a request that had not started
once, on a fresh stream, even with one core; a second lost status ends it with INTERNAL.

The race cannot be produced on demand, so the client's stub hands out a stand-in stream call
that reads the lost status for the first `lost` MultiplexGenerate calls; every other call,
Generate included, goes to a real core on loopback that lacks MultiplexGenerate.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_client import LOST_STATUS, CoreClient
from gateways.common.status import GatewayError
from gateways.common.streaming import collect
from tests.integration.test_fleet_prefix import generate_only  # noqa: F401 (a fixture)


class _LostStatusCall:
    """A MultiplexGenerate call whose server ended it while the client wrote."""

    async def write(self, msg: Any) -> None:
        pass

    async def done_writing(self) -> None:
        pass

    async def read(self) -> Any:
        raise AioRpcError(grpc.StatusCode.INTERNAL, Metadata(), Metadata(), details=LOST_STATUS)


class _LosingStub:
    """The client's stub, but its first `lost` MultiplexGenerate calls lose their status."""

    def __init__(self, stub: Any, lost: int):
        self._stub = stub
        self.lost = lost
        self.streams = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def MultiplexGenerate(self, metadata: Any = None) -> Any:
        self.streams += 1
        if self.streams <= self.lost:
            return _LostStatusCall()
        return self._stub.MultiplexGenerate(metadata=metadata)


def _request() -> spb.GenerateRequest:
    request = spb.GenerateRequest(request_id="lost-1", text="The cat")
    request.stopping.max_new_tokens = 3
    return request


@pytest.fixture
async def client(start_mock_core, generate_only):  # noqa: F811
    core = await start_mock_core()
    client = CoreClient(await generate_only(core))
    yield client
    await client.close()


async def test_a_lost_status_is_resent_once_and_falls_back_to_generate(client):
    stub = client.stub = _LosingStub(client.stub, lost=1)
    responses = await collect(client.generate(_request()))
    assert responses[-1].HasField("usage") and responses[-1].usage.completion_tokens == 3
    # the lost stream, then a fresh one that read UNIMPLEMENTED: the request went to Generate
    assert stub.streams == 2


async def test_a_second_lost_status_ends_the_request_with_internal(client):
    stub = client.stub = _LosingStub(client.stub, lost=2)
    with pytest.raises(GatewayError) as failed:
        await collect(client.generate(_request()))
    assert (failed.value.code, failed.value.message) == (grpc.StatusCode.INTERNAL, LOST_STATUS)
    assert stub.streams == 2
