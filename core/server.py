"""Builds and runs the core's grpc.aio server: GenerateService, grpc.health.v1 and reflection.

`start_core()` loads the tokenizer and engine, wires the pipeline and returns a running
CoreServer (tests use it in-process on port 0). `CoreServer.stop()` is the graceful path taken
on SIGTERM: health flips to NOT_SERVING, new calls are refused with UNAVAILABLE, in-flight
streams may finish until the drain deadline, then the engine shuts down.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.config import CoreConfig
from core.engine.base import Engine
from core.engine.registry import create_engine, tokenizer_path
from core.pipeline import RequestPipeline
from core.service import GenerateServicer
from core.sessions import SessionStore
from core.tokenizer import Tokenizer
from core.validation import Limits

log = logging.getLogger(__name__)

SERVICE_NAME = spb.DESCRIPTOR.services_by_name["GenerateService"].full_name


@dataclass
class CoreServer:
    """A running core: its gRPC server, bound port, engine and health servicer."""

    config: CoreConfig
    server: grpc.aio.Server
    port: int
    engine: Engine
    servicer: GenerateServicer
    health: health_aio.HealthServicer

    @property
    def address(self) -> str:
        """host:port clients connect to."""
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, let streams finish for `grace`
        seconds (default config.drain_seconds), cancel the rest, shut the engine down."""
        grace = self.config.drain_seconds if grace is None else grace
        self.servicer.drain()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.engine.shutdown()


def server_options(config: CoreConfig) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: message size limits, and the connection age after
    which clients get GOAWAY (grpc.max_connection_age_ms, with grpc.max_connection_age_grace_ms
    for the streams still open), so clients re-resolve and balance over replicas added since."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]
    if config.max_connection_age_seconds > 0:
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.max_connection_age_grace_seconds * 1000)),
        ]
    return options


async def start_core(
    config: CoreConfig, engine: Engine | None = None, tokenizer: Tokenizer | None = None
) -> CoreServer:
    """Load, wire and start a core.

    Args:
        config: the effective configuration.
        engine: an engine to use instead of the one config.engine names (unstarted).
        tokenizer: a tokenizer to use instead of loading one.

    Raises:
        RuntimeError / OSError: the model, tokenizer or engine dependencies cannot be loaded, or
            the address cannot be listened on (the engine is shut down again in every case).
    """
    tokenizer = tokenizer or Tokenizer.load(tokenizer_path(config))
    engine = engine or create_engine(config, tokenizer)
    try:
        await engine.start()
        return await _listen(config, engine, tokenizer)
    except BaseException:
        await engine.shutdown()
        raise


async def _listen(config: CoreConfig, engine: Engine, tokenizer: Tokenizer) -> CoreServer:
    """Wire the pipeline to a started engine and serve it on config.host:config.port."""
    info = engine.info
    limits = Limits(
        served_model=config.served_model_name,
        engine=info,
        max_new_tokens=min(config.max_new_tokens or info.max_context_length, info.max_context_length),
        max_stop_sequences=config.max_stop_sequences,
        max_n=min(config.max_n, info.max_n),
    )
    sessions = SessionStore(config.session_max_tokens, config.session_ttl_seconds)
    pipeline = RequestPipeline(engine, tokenizer, sessions, limits, config.default_max_new_tokens)
    servicer = GenerateServicer(pipeline, config)
    server = grpc.aio.server(options=server_options(config))
    spb_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as e:  # grpc's way of saying the address is taken or not ours
        raise OSError(f"cannot listen on {config.host}:{config.port} (in use, or not an address of this host)") from e
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)

    pending: set[asyncio.Task[None]] = set()

    def on_dead(error: Exception) -> None:
        log.error("engine is dead (%s); health is now NOT_SERVING", error)
        for name in ("", SERVICE_NAME):
            task = asyncio.ensure_future(health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
            pending.add(task)
            task.add_done_callback(pending.discard)

    engine.set_on_dead(on_dead)
    return CoreServer(config, server, port, engine, servicer, health)
