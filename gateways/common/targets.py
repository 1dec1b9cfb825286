"""Where a gateway's cores are, and how grpcio balances over them: the `--core` target and the
gRPC service configs of the gateway's channels (pure functions; `core_client` uses them).

`--core` takes one `host:port`, several separated by commas (`ipv4:`/`ipv6:` target lists, or
one `dns:///` target per name when names are given), or any gRPC target URI as is
(`dns:///cores.trellis.svc:50051`, a Kubernetes headless Service: one address per ready pod,
re-resolved by grpcio when a connection drops).

Two service configs (grpc/doc/service_config.md; policies of grpcio's C-core):

- the balanced channel: `round_robin` over every resolved address, with client-side health
  checking (`healthCheckConfig`, gRFC A17: each subchannel watches grpc.health.v1 `Watch` for
  the GenerateService, so a draining or dead-engine core, NOT_SERVING, takes no new call; a core
  without the health service counts as healthy). C-core turns health checking on from the
  service config alone, in every wrapped language (src/core/load_balancing/health_check_client.cc);
  the channel argument `grpc.inhibit_health_checking` is the only switch, and Trellis leaves it
  unset. The unary methods (GetModelInfo, health Check, the Generate fallback) get gRPC's retry
  policy (gRFC A6) for UNAVAILABLE; the multiplexed streams retry in `core_client`, as one
  stream carries many requests.
- the session channel: `ring_hash_experimental` with `requestHashHeader` (gRFC A76), so a
  request carrying the header goes to the core its value hashes to on the ring, or the next
  connected one clockwise when that core is gone. grpcio 1.85's C-core parses
  `requestHashHeader` only with GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true in the
  environment (src/core/load_balancing/ring_hash/ring_hash.cc, `RingHashJsonArgs`);
  `enable_request_hash_header()` sets it. The policy's registered name is
  `ring_hash_experimental` in that release.

The load-aware `weighted_round_robin` (gRFC A58) weighs cores by ORCA load reports, which the
Python server (grpcio) cannot send, so it would degrade to round_robin here: not used.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass

from trellis.generate.v1 import generate_service_pb2 as spb

#: The gRPC service of the Generate contract.
GENERATE_SERVICE = spb.DESCRIPTOR.services_by_name["GenerateService"].full_name

#: The service whose health decides whether a core takes requests (the core serves it with "").
HEALTH_SERVICE = GENERATE_SERVICE

#: Extra attempts the balanced channel makes of a call refused before its response started.
RETRIES = 2

#: The metadata key whose value places a session stream on the ring (lowercase: HTTP/2).
HASH_HEADER = "trellis-session-bucket"

_RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"


@dataclass(frozen=True)
class CoreTarget:
    """A parsed `--core`.

    Attributes:
        uri: the gRPC target the channel connects to.
        addresses: how many addresses the flag listed (1 for a single address or a resolver
            URI, whose address count is known only to the resolver).
        resolved: the target is a resolver URI (dns:, ipv4:, unix: ...) that may hold any number
            of cores.
    """

    uri: str
    addresses: int
    resolved: bool

    @property
    def several(self) -> bool:
        """Whether the target may hold more than one core."""
        return self.addresses > 1 or self.resolved


def parse_core_target(value: str) -> CoreTarget:
    """The gRPC target of a `--core` value.

    `host:port` stays as is; `a:1,b:2` becomes `ipv4:a:1,b:2` when every host is an IPv4
    address, `ipv6:[::1]:1,[::1]:2` for IPv6, and a `dns:///` target for one name listed alone;
    a value with `:///` or a scheme prefix (`dns:`, `ipv4:`, `ipv6:`, `unix:`) is a gRPC target
    URI, used as is (grpc/doc/naming.md).

    Raises:
        ValueError: an empty value or element, an element without a port, or a list that mixes
            names and addresses or lists several names (grpc has no list target for names: use
            one `dns:///` name resolving to every core).
    """
    value = value.strip()
    if not value:
        raise ValueError("--core is empty; give host:port, a comma-separated list, or a dns:/// target")
    if "://" in value or value.split(":", 1)[0] in ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock"):
        return CoreTarget(uri=value, addresses=max(1, value.count(",") + 1), resolved=True)
    parts = [p.strip() for p in value.split(",")]
    kinds = set()
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not part or not sep or not host or not port.isdigit():
            raise ValueError(f"--core {value!r}: {part!r} is not host:port")
        host = host.strip("[]")
        try:
            kinds.add("ipv4" if ipaddress.ip_address(host).version == 4 else "ipv6")
        except ValueError:
            kinds.add("name")
    if len(parts) == 1:
        return CoreTarget(uri=parts[0], addresses=1, resolved=False)
    if kinds == {"ipv4"} or kinds == {"ipv6"}:
        return CoreTarget(uri=f"{kinds.pop()}:{','.join(parts)}", addresses=len(parts), resolved=False)
    raise ValueError(
        f"--core {value!r}: a list takes IP addresses only (all IPv4 or all IPv6); for host names use one "
        "dns:///name:port target that resolves to every core (a Kubernetes headless Service)"
    )


def listed_addresses(target: CoreTarget) -> list[str] | None:
    """The `host:port` of every core a target lists, for routing that addresses each core
    (`--routing prefix`): one address, or an `ipv4:`/`ipv6:` list (grpc/doc/naming.md); None
    for a target only a resolver expands (`dns:`, `unix:` ...), whose addresses come from
    `dns_name` and a lookup.
    """
    uri = target.uri
    scheme, _, rest = uri.partition(":")
    if scheme in ("ipv4", "ipv6") and not rest.startswith("//"):
        return [part.strip() for part in rest.split(",") if part.strip()]
    return None if target.resolved else [uri]


def dns_name(target: CoreTarget) -> tuple[str, int] | None:
    """(host, port) of a `dns:///host:port` or `dns://authority/host:port` target (the
    authority, a DNS server, is left to the system resolver); None for any other target.

    Raises:
        ValueError: a dns: target without a numeric port (grpc's dns resolver would default to
            443, which is never a core's).
    """
    uri = target.uri
    if not uri.startswith("dns:"):
        return None
    name = uri[4:]
    if name.startswith("//"):
        name = name[2:].split("/", 1)[1] if "/" in name[2:] else ""
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--core {uri!r}: a dns: target for --routing prefix needs host:port")
    return host.strip("[]"), int(port)


def address_target(address: str) -> str:
    """The gRPC target of one core's `host:port` (IPv6 hosts bracketed, as grpc expects)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"ipv6:[{host}]:{port}"
        return f"ipv4:{host}:{port}"
    except ValueError:
        return address


def balanced_service_config() -> str:
    """The service config (JSON) of the balanced channel: round_robin, health checking of
    HEALTH_SERVICE, and gRPC retries of UNAVAILABLE (gRFC A6: only a call refused before its
    response started is retried; RETRIES more attempts) for the unary methods and the Generate
    fallback; the requests on a MultiplexGenerate stream are retried by `core_client`, one by
    one."""
    retry = {
        "maxAttempts": RETRIES + 1,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    methods = [
        {"service": GENERATE_SERVICE, "method": "GetModelInfo"},
        {"service": GENERATE_SERVICE, "method": "Generate"},
        {"service": "grpc.health.v1.Health", "method": "Check"},
    ]
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": HEALTH_SERVICE},
            "methodConfig": [{"name": methods, "retryPolicy": retry}],
        }
    )


def session_service_config() -> str:
    """The service config (JSON) of the session channel: ring_hash on HASH_HEADER (gRFC A76)."""
    return json.dumps(
        {"loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": HASH_HEADER, "minRingSize": 1024}}]}
    )


def enable_request_hash_header() -> None:
    """Let grpcio's C-core read `requestHashHeader` (read when a service config is parsed)."""
    os.environ[_RING_HASH_ENV] = "true"
