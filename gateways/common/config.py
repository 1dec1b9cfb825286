"""Gateway configuration: common flags plus each gateway's own, all with environment fallbacks.

Every flag `--some-flag` can also be set as `TRELLIS_GATEWAY_SOME_FLAG`; the command line wins
(envflags.EnvArgumentParser, shared with the core). A gateway adds its own flags in
`add_arguments(parser)` (its config.py) and turns the parsed values into its typed settings
dataclass once, with `settings_from`; handlers read that dataclass from the app, never a flag by
name.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from envflags import EnvArgumentParser, ListAction, comma_list
from envflags.tls import add_server_tls_arguments
from gateways.common.prefix_route import DEFAULT_ADAPTER_LOAD_FACTOR, DEFAULT_LOAD_FACTOR, DEFAULT_PREFIX_CHARS
from gateways.common.targets import dns_name, listed_addresses, parse_core_target
from oteltrace import add_tracing_arguments, resolve_tracing

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

S = TypeVar("S", bound="DataclassInstance")

ENV_PREFIX = "TRELLIS_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig:
    """Effective configuration of one gateway process.

    Attributes:
        name: gateway kind ("lmi", "openai", "triton", "ws").
        core: address of the core's gRPC server (host:port).
        host, port: where the gateway listens.
        request_timeout: seconds a whole request may take end to end (0: no limit).
        queue_timeout: seconds a request may wait in the core's queue before it is scheduled
            (0: no limit); then 504 (DEADLINE_EXCEEDED, reason QUEUE_TIMEOUT).
        max_body_bytes: largest request body accepted (larger bodies get 413), on the wire and
            once decompressed.
        keepalive_timeout: seconds an idle keep-alive connection stays open (aiohttp counts
            from the accept too, and closes a connection still waiting for a request then).
        header_timeout: seconds from a connection's accept to the end of its first request's
            headers; then it is closed (0: only keepalive_timeout applies).
        max_connections: client connections open at once; beyond, a new one is answered 503
            and closed (0: gateways.common.connections.default_max_connections, below the
            file descriptor limit).
        accept_error_log_interval: seconds between two logs of accept() failing for lack of
            file descriptors (the others are counted).
        max_buffered_bytes: bytes of a streamed response kept for a client that reads slower
            than they come; beyond, the request is cancelled and the connection aborted.
        write_timeout: seconds a streamed response waits for a client that takes nothing
            while data waits for it; then the same (0: no limit).
        max_message_bytes: gRPC message size limit towards the core.
        max_json_depth: deepest nesting of arrays and objects in a request body or frame.
        retry_after_seconds: the Retry-After of 429 and 503 responses.
        log_level: logging level name.
        api_key: keys HTTP clients must send (`Authorization: Bearer`); empty: no check.
        core_api_key: the key sent to the core (`authorization` metadata); empty: none.
        metrics_require_key: `GET /metrics` needs a key too.
        ssl_certfile, ssl_keyfile, ssl_ca_certs, ssl_cert_reqs: HTTPS to clients
            (gateways.common.tls.server_ssl_context; flags and their rules: envflags.tls).
        core_tls, core_ssl_ca_certs, core_ssl_certfile, core_ssl_keyfile: TLS to the core
            (gateways.common.tls.channel_credentials).
        drain_seconds: on SIGTERM, how long health reports not serving, while requests are
            still served, before the listener closes and in-flight requests finish.
        core_streams: MultiplexGenerate streams the gateway keeps open over its cores (0: two
            per listed address and at least 4 when the target may hold several cores, else 1).
        core_stream_max_age: seconds a stream takes new requests before a fresh one replaces it
            (so new and returning cores get streams; 0: never).
        core_retries: times a request refused before its first message (UNAVAILABLE,
            RESOURCE_EXHAUSTED) is sent again, to another core when there is one.
        core_reconnect_backoff_ms: first delay before reconnecting to a core that went away
            (grpc.initial_reconnect_backoff_ms; also grpc.min_reconnect_backoff_ms).
        core_max_reconnect_backoff_ms: longest delay between reconnection attempts
            (grpc.max_reconnect_backoff_ms): a core that comes back is served within about that.
        routing: how requests without a session pick one of several cores: "round_robin" or
            "prefix" (by prefix, or by LoRA adapter: gateways.common.prefix_route; docs/fleet.md
            weighs them).
        routing_prefix_chars: characters of a text prompt that make its prefix key.
        routing_load_factor: the `c` of bounded loads (a core takes a request while its
            requests in flight are below c times the average).
        routing_adapter_load_factor: the same for a request naming a LoRA adapter.
        otlp_traces_endpoint, otlp_traces_sample_ratio: OpenTelemetry traces of every request
            (gateways.common.tracing; flags, OTEL_* variables and rules: oteltrace); "" and
            None: as the variables say, else off.
        options: the gateway's own flags as parsed (by argparse dest), the input of its
            settings dataclass (`settings_from`).
    """

    name: str
    core: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 0
    request_timeout: float = 0.0
    queue_timeout: float = 0.0
    max_body_bytes: int = 2 * 1024 * 1024
    keepalive_timeout: float = 75.0
    header_timeout: float = 10.0
    max_connections: int = 0
    accept_error_log_interval: float = 1.0
    max_buffered_bytes: int = 4 * 1024 * 1024
    write_timeout: float = 60.0
    max_message_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 32
    retry_after_seconds: int = 1
    log_level: str = "INFO"
    api_key: tuple[str, ...] = ()
    core_api_key: str = ""
    metrics_require_key: bool = False
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    core_tls: bool = False
    core_ssl_ca_certs: str | None = None
    core_ssl_certfile: str | None = None
    core_ssl_keyfile: str | None = None
    drain_seconds: float = 5.0
    core_streams: int = 0
    core_stream_max_age: float = 30.0
    core_retries: int = 2
    core_reconnect_backoff_ms: int = 100
    core_max_reconnect_backoff_ms: int = 500
    routing: str = "round_robin"
    routing_prefix_chars: int = DEFAULT_PREFIX_CHARS
    routing_load_factor: float = DEFAULT_LOAD_FACTOR
    routing_adapter_load_factor: float = DEFAULT_ADAPTER_LOAD_FACTOR
    otlp_traces_endpoint: str = ""
    otlp_traces_sample_ratio: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def redacted(self) -> dict[str, Any]:
        """The configuration for the start-up log, keys replaced by their count."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["api_key"] = f"<{len(self.api_key)} keys>"
        out["core_api_key"] = "<set>" if self.core_api_key else ""
        out["options"] = dict(self.options)
        return out


def settings_from(cls: type[S], options: Mapping[str, Any]) -> S:
    """A gateway's settings dataclass from its parsed flags: each field takes the option of the
    same name (argparse dest); a field without an option keeps its default.

    Raises:
        TypeError: `cls` is not a dataclass.
    """
    names = {f.name for f in fields(cls)}
    return cls(**{name: value for name, value in options.items() if name in names})


_COMMON = {
    "core",
    "host",
    "port",
    "request_timeout",
    "queue_timeout",
    "max_body_bytes",
    "keepalive_timeout",
    "header_timeout",
    "max_connections",
    "accept_error_log_interval",
    "max_buffered_bytes",
    "write_timeout",
    "max_message_bytes",
    "max_json_depth",
    "retry_after_seconds",
    "log_level",
    "api_key",
    "core_api_key",
    "metrics_require_key",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_ca_certs",
    "ssl_cert_reqs",
    "core_tls",
    "core_ssl_ca_certs",
    "core_ssl_certfile",
    "core_ssl_keyfile",
    "drain_seconds",
    "routing",
    "routing_prefix_chars",
    "routing_load_factor",
    "routing_adapter_load_factor",
    "otlp_traces_endpoint",
    "otlp_traces_sample_ratio",
}
_COMMON |= {f.name for f in fields(GatewayConfig) if f.name.startswith("core_")}


def _first_key(raw: str) -> str:
    """The first key of a comma-separated list (the core's variable may hold several)."""
    keys = comma_list(raw)
    return keys[0] if keys else ""


def add_core_arguments(p: EnvArgumentParser, d: GatewayConfig) -> None:
    """The flags of the gateway's connection to its cores (balancing, retries, reconnection)."""
    p.add_argument(
        "--core-streams",
        type=int,
        default=d.core_streams,
        help="MultiplexGenerate streams spread over the cores (0: two per listed address, at least 4 for "
        "several cores; 1 for one core)",
    )
    p.add_argument(
        "--core-stream-max-age",
        type=float,
        default=d.core_stream_max_age,
        help="seconds a stream takes new requests before a fresh one replaces it, so new or returning "
        "cores get traffic (0: never)",
    )
    p.add_argument(
        "--core-retries",
        type=int,
        default=d.core_retries,
        help="times a request refused before its first message (UNAVAILABLE, RESOURCE_EXHAUSTED) is resent, "
        "to another core when there is one",
    )
    p.add_argument(
        "--core-reconnect-backoff-ms",
        type=int,
        default=d.core_reconnect_backoff_ms,
        help="first delay before reconnecting to a core that went away (grpc.initial_reconnect_backoff_ms)",
    )
    p.add_argument(
        "--core-max-reconnect-backoff-ms",
        type=int,
        default=d.core_max_reconnect_backoff_ms,
        help="longest delay between reconnection attempts (grpc.max_reconnect_backoff_ms): a core that comes "
        "back is served within about this",
    )
    p.add_argument(
        "--routing",
        choices=["round_robin", "prefix"],
        default=d.routing,
        help="how a request picks one of several cores: round_robin (the least-loaded stream) or prefix (a "
        "consistent hash of its leading part, or of its LoRA adapter's name, with bounded loads, so shared prefixes "
        "meet their cache and adapters stay resident on few cores); sessions keep their core either way",
    )
    p.add_argument(
        "--routing-prefix-chars",
        type=int,
        default=d.routing_prefix_chars,
        help="--routing prefix: characters of a prompt that make its key (a chat's key is its messages up to the "
        "first user message)",
    )
    p.add_argument(
        "--routing-load-factor",
        type=float,
        default=d.routing_load_factor,
        help="--routing prefix: a core takes a request while its requests in flight are below this times the "
        "average (bounded loads; at least 1)",
    )
    p.add_argument(
        "--routing-adapter-load-factor",
        type=float,
        default=d.routing_adapter_load_factor,
        help="--routing prefix: the same for a request naming a LoRA adapter, which goes to a core holding the "
        "adapter while that core is below this times the average (at least 1)",
    )


def load(
    name: str,
    default_port: int,
    add_arguments: Callable[[EnvArgumentParser], None],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Parse the flags of gateway `name` (argv without the gateway name).

    Raises:
        SystemExit: on a usage error (argparse prints the message).
    """
    environ = os.environ if environ is None else environ
    p = EnvArgumentParser(
        prog=f"trellis-gateway {name}",
        description=f"Trellis {name} gateway: translate its public schema into gRPC Generate calls.",
        env_prefix=ENV_PREFIX,
        environ=environ,
    )
    d = GatewayConfig(name=name)
    p.add_argument(
        "--core",
        default=d.core,
        help="core gRPC address host:port, a comma-separated list of IP:port, or a gRPC target such as "
        "dns:///cores:50051 (every address it resolves to is a core)",
    )
    p.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0: pick a free one)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request (0: none)")
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=d.queue_timeout,
        help="seconds a request may wait to be scheduled (0: none)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body, decompressed (413 above)"
    )
    p.add_argument(
        "--keepalive-timeout", type=float, default=d.keepalive_timeout, help="seconds an idle connection stays open"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds a new connection may take to send its first request's headers (0: --keepalive-timeout only)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="client connections open at once; more are answered 503 and closed (0: the soft file descriptor "
        "limit less a quarter of it, at least 64)",
    )
    p.add_argument(
        "--accept-error-log-interval",
        type=float,
        default=d.accept_error_log_interval,
        help="seconds between two logs of accept() failing at the file descriptor limit (the rest are counted)",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=d.max_buffered_bytes,
        help="bytes of a streamed response kept for a slow client before its request is cancelled",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout,
        help="seconds a streamed response waits for a client that takes nothing (0: no limit)",
    )
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="gRPC message size limit")
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth, help="deepest nesting of arrays and objects")
    p.add_argument(
        "--retry-after-seconds", type=int, default=d.retry_after_seconds, help="Retry-After of 429 and 503 answers"
    )
    p.add_argument("--log-level", default=d.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--api-key",
        action=ListAction,
        type=comma_list,
        default=[],
        help="accept only requests with 'Authorization: Bearer KEY' (repeatable, or comma-separated; health "
        "routes stay open)",
    )
    p.add_argument(
        "--core-api-key",
        type=_first_key,
        default="",
        env_aliases=("TRELLIS_CORE_API_KEY",),
        help="API key sent to the core (its --api-key)",
    )
    p.add_argument(
        "--metrics-require-key",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="GET /metrics needs an API key too (default: open)",
    )
    add_server_tls_arguments(p, serves="HTTPS (and WSS)", label="HTTPS")
    p.add_argument(
        "--core-tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="connect to the core over TLS, verified with the system's CAs (implied by --core-ssl-ca-certs)",
    )
    p.add_argument("--core-ssl-ca-certs", default=None, help="connect to the core over TLS, verified with this CA")
    p.add_argument("--core-ssl-certfile", default=None, help="client certificate for a core that requires one (mTLS)")
    p.add_argument("--core-ssl-keyfile", default=None, help="the client certificate's PEM private key")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=d.drain_seconds,
        help="on SIGTERM, seconds health reports not serving (requests still served) before the listener "
        "closes and in-flight requests finish",
    )
    add_tracing_arguments(p)
    add_core_arguments(p, d)
    add_arguments(p)
    ns = vars(p.parse_args(argv))
    ns["api_key"] = tuple(ns["api_key"])
    try:
        target = parse_core_target(ns["core"])
        if ns["routing"] == "prefix" and listed_addresses(target) is None and dns_name(target) is None:
            p.error(
                f"--routing prefix needs the cores' addresses: a list, an ipv4:/ipv6: target or a dns: name, "
                f"not {target.uri!r}"
            )
        resolve_tracing(ns["otlp_traces_endpoint"], ns["otlp_traces_sample_ratio"], environ)
    except ValueError as e:
        p.error(str(e))
    if ns["routing_prefix_chars"] < 1:
        p.error(f"--routing-prefix-chars must be >= 1, got {ns['routing_prefix_chars']}")
    if not ns["routing_load_factor"] >= 1:
        p.error(f"--routing-load-factor must be >= 1, got {ns['routing_load_factor']}")
    if not ns["routing_adapter_load_factor"] >= 1:
        p.error(f"--routing-adapter-load-factor must be >= 1, got {ns['routing_adapter_load_factor']}")
    non_negative = ("header_timeout", "max_connections", "accept_error_log_interval", "drain_seconds")
    for dest in (*non_negative, "core_streams", "core_stream_max_age", "core_retries", "core_reconnect_backoff_ms"):
        if ns[dest] < 0:
            p.error(f"--{dest.replace('_', '-')} must be >= 0, got {ns[dest]}")
    if ns["core_max_reconnect_backoff_ms"] < max(1, ns["core_reconnect_backoff_ms"]):
        p.error("--core-max-reconnect-backoff-ms must be >= --core-reconnect-backoff-ms and > 0")
    common = {k: ns.pop(k) for k in list(ns) if k in _COMMON}
    return GatewayConfig(name=name, options=ns, **common)
