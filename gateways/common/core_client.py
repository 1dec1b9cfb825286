"""The gateway's connection to the core: one grpc.aio channel, typed calls, cached model info.

Lives on the aiohttp app (`CORE_CLIENT_KEY`) for the app's lifetime (`core_client_ctx`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias, cast

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from gateways.common.config import GatewayConfig
from gateways.common.status import GatewayError

#: A Generate call of the core (grpc.aio's server-streaming call object).
GenerateCall: TypeAlias = grpc.aio.UnaryStreamCall[spb.GenerateRequest, spb.GenerateResponse]


class CoreClient:
    """Calls into the core's GenerateService.

    Args:
        address: host:port of the core.
        max_message_bytes: gRPC message size limit.
        timeout: per-call deadline in seconds (None: no deadline).
    """

    def __init__(self, address: str, *, max_message_bytes: int = 16 * 1024 * 1024, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self.stub = spb_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._model_info: spb.GetModelInfoResponse | None = None

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        await self._channel.close()

    def generate(self, request: spb.GenerateRequest) -> GenerateCall:
        """Start a Generate stream; iterate it, and cancel it in a `finally`."""
        return cast(GenerateCall, self.stub.Generate(request, timeout=self.timeout))

    async def model_info(self) -> spb.GetModelInfoResponse:
        """The served model's info (cached after the first success).

        Raises:
            GatewayError: the core cannot be reached (UNAVAILABLE) or fails.
        """
        if self._model_info is None:
            try:
                info = await self.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=10)
                self._model_info = cast(spb.GetModelInfoResponse, info)
            except grpc.RpcError as e:
                raise GatewayError.from_rpc_error(e) from None
        return self._model_info

    async def serving(self) -> bool:
        """Whether the core answers grpc.health.v1 Check with SERVING (within 2 s)."""
        try:
            # types-grpcio-health-checking declares HealthStub without its methods.
            resp = await self._health.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=""), timeout=2.0
            )
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


CORE_CLIENT_KEY = web.AppKey("core_client", CoreClient)
CONFIG_KEY = web.AppKey("gateway_config", GatewayConfig)


async def core_client_ctx(app: web.Application) -> AsyncIterator[None]:
    """aiohttp cleanup_ctx: open the core client at startup, close it at cleanup."""
    config = app[CONFIG_KEY]
    client = CoreClient(
        config.core,
        max_message_bytes=config.max_message_bytes,
        timeout=config.request_timeout or None,
    )
    app[CORE_CLIENT_KEY] = client
    yield
    await client.close()
