"""Builds and runs the core's grpc.aio server: GenerateService, grpc.health.v1 and reflection.

`start_core()` loads the tokenizer and engine, wires the pipeline and returns a running
CoreServer (tests use it in-process on port 0). `CoreServer.stop()` is the graceful path taken
on SIGTERM: health flips to NOT_SERVING, new calls are refused with UNAVAILABLE, in-flight
streams may finish until the drain deadline, then the engine shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from trellis.generate.v1 import generate_service_pb2 as spb

from core.auth import ApiKeyInterceptor
from core.config import CoreConfig
from core.engine.base import Engine
from core.engine.registry import create_engine, tokenizer_path
from core.errors import CoreError
from core.lora import lora_of, read_spec, startup_adapters
from core.metrics import CoreCollector, MetricsServer, core_registry, serve_metrics
from core.pipeline import RequestPipeline
from core.service import GenerateServicer
from core.sessions import SessionStore
from core.tenants import Tenants
from core.tls import server_credentials
from core.tokenizer import Tokenizer
from core.tracing import SCOPE, CoreTracing
from core.validation import Limits, prompt_chars_bound
from core.wire import add_generate_service
from envflags.apikeys import ApiKeys
from oteltrace import resolve_tracing, start_tracing

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
    metrics: MetricsServer | None = None

    @property
    def address(self) -> str:
        """host:port clients connect to."""
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: health answers NOT_SERVING, new calls are refused with UNAVAILABLE,
        in-flight streams may finish for `grace` seconds (default config.drain_seconds); then
        the rest are cancelled, the port closes and the engine shuts down.

        Until the port closes, grpc.health.v1 Check keeps answering NOT_SERVING (a server in
        grpc's own graceful stop refuses every new call, health checks included, which a load
        balancer reads as a failed probe rather than a draining replica)."""
        grace = self.config.drain_seconds if grace is None else grace
        self.servicer.drain()
        await self.health.enter_graceful_shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.wait_idle(), grace)
        await self.server.stop(0)
        await self.engine.shutdown()
        if self.metrics is not None:
            self.metrics.stop()
        tracing = self.servicer.tracing
        if tracing is not None:  # the spans of the last requests go out before the process ends
            await asyncio.to_thread(tracing.tracing.shutdown)


def server_options(config: CoreConfig) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: message size limits; the connection age after
    which clients get GOAWAY (grpc.max_connection_age_ms, with grpc.max_connection_age_grace_ms
    for the streams still open), so clients re-resolve and balance over replicas added since;
    and no SO_REUSEPORT (grpc.so_reuseport 0). With it, which grpc enables by default, a second
    server binds a port another one holds without an error and the kernel splits the
    connections between the two, and a port chosen by the system (port 0) can be one another
    server holds (grpc/grpc#10755); without it, such a start fails with "cannot listen"."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
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
            the address cannot be listened on, or a TLS file cannot be read (the engine is shut
            down again in every case).
        ValueError: inconsistent TLS flags (core.tls.server_credentials), or
            --metrics-require-key without --api-key.
    """
    tokenizer = tokenizer or Tokenizer.load(tokenizer_path(config))
    engine = engine or create_engine(config, tokenizer)
    try:
        await engine.start()
        await register_startup_adapters(config, engine)
        return await _listen(config, engine, tokenizer)
    except BaseException:
        await engine.shutdown()
        raise


async def register_startup_adapters(config: CoreConfig, engine: Engine) -> None:
    """Register the adapters of `<model>/adapters/` and `--lora-modules` (core.lora) on a
    started engine.

    Raises:
        RuntimeError: one of them cannot be registered (the message names it and says why),
            or there are some and the engine serves no adapters.
    """
    found = startup_adapters(config.model, config.lora_modules)
    if not found:
        return
    lora = lora_of(engine)
    if lora is None:
        raise RuntimeError(
            f"adapters to serve ({', '.join(name for name, _ in found)}) but the engine serves none (--max-loras 0?)"
        )
    for name, path in found:
        try:
            spec = read_spec(
                name,
                path,
                max_rank=config.max_lora_rank,
                model_path=config.model,
                served_model=config.served_model_name,
            )
            await lora.load_adapter(spec)
        except CoreError as e:
            raise RuntimeError(f"cannot serve adapter {name} from {path}: {e.message}") from None
        log.info("adapter %s from %s (rank %d)", name, path, spec.rank)


async def _listen(config: CoreConfig, engine: Engine, tokenizer: Tokenizer) -> CoreServer:
    """Wire the pipeline to a started engine and serve it on config.host:config.port."""
    info = engine.info
    limits = Limits(
        served_model=config.served_model_name,
        model_aliases=config.model_aliases,
        engine=info,
        max_new_tokens=min(config.max_new_tokens or info.max_context_length, info.max_context_length),
        max_stop_sequences=config.max_stop_sequences,
        max_n=min(config.max_n, info.max_n),
        max_prompt_chars=prompt_chars_bound(info.max_context_length, tokenizer.max_token_chars),
        max_stop_chars=config.max_stop_sequence_chars,
        max_logit_bias=config.max_logit_bias,
    )
    sessions = SessionStore(config.session_max_tokens, config.session_ttl_seconds, max_bytes=config.session_max_bytes)
    tenants = Tenants(config.tenant_max_running, config.tenant_tokens_per_minute)
    pipeline = RequestPipeline(
        engine,
        tokenizer,
        sessions,
        limits,
        config.default_max_new_tokens,
        allow_special_tokens_in_content=config.allow_special_tokens_in_content,
        tenants=tenants,
        by_priority=config.scheduling_policy == "priority",
    )
    if config.metrics_require_key and not config.api_key:
        raise ValueError("--metrics-require-key needs --api-key")
    keys = ApiKeys(config.api_key) if config.api_key else None
    settings = resolve_tracing(config.otlp_traces_endpoint, config.otlp_traces_sample_ratio)
    tracing = None
    if settings is not None:
        tracing = CoreTracing(start_tracing(settings, "trellis-core", SCOPE), config.served_model_name)
        log.info("exporting traces to %s (sample ratio %g)", settings.endpoint, settings.ratio)
    servicer = GenerateServicer(pipeline, config, keys, tracing)
    interceptors = [ApiKeyInterceptor(keys)] if keys is not None else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=server_options(config),
    )
    add_generate_service(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    credentials = server_credentials(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs)
    try:
        address = f"{config.host}:{config.port}"
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's way of saying the address is taken or not ours
        raise OSError(f"cannot listen on {config.host}:{config.port} (in use, or not an address of this host)") from e
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)

    pending: set[asyncio.Task[None]] = set()

    def set_health(status: int) -> None:
        # Once draining, grpc's HealthServicer ignores `set`: health stays NOT_SERVING.
        for name in ("", SERVICE_NAME):
            task = asyncio.ensure_future(health.set(name, status))
            pending.add(task)
            task.add_done_callback(pending.discard)

    def on_dead(error: Exception) -> None:
        log.error("engine is dead (%s); health is now NOT_SERVING", error)
        set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_health(serving: bool) -> None:
        if engine.alive:
            status = health_pb2.HealthCheckResponse
            set_health(status.SERVING if serving else status.NOT_SERVING)

    engine.set_on_dead(on_dead)
    engine.set_on_health(on_health)
    metrics = None
    if config.metrics_port is not None:
        collector = CoreCollector(
            pipeline.metrics, engine, sessions, config.max_batch_size, config.served_model_name, pipeline.tenants
        )
        try:
            keys = ApiKeys(config.api_key) if config.metrics_require_key else None
            metrics = serve_metrics(core_registry(collector), config.host, config.metrics_port, keys)
        except OSError as e:
            await server.stop(None)
            raise OSError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {e}") from e
        log.info("Prometheus metrics on http://%s:%d/metrics", config.host, metrics.port)
    return CoreServer(config, server, port, engine, servicer, health, metrics)
