"""The gateway's connection to its cores: grpc.aio channels balanced by grpcio, Generate
requests multiplexed on a pool of MultiplexGenerate streams (gateways.common.multiplexed),
cached model info, health.

`CoreClient.generate(request)` starts a request and returns its `CoreCall`
(gateways.common.core_call): the request's deltas as they arrive, then its end (OK, or a
GatewayError). A core without MultiplexGenerate (UNIMPLEMENTED) is served with one Generate call
per request instead, the requests waiting on the refused stream included.

Many cores (`--core` a list or a dns:/// target; gateways.common.targets): a stream is one
HTTP/2 stream, pinned to the core its channel's balancer picked when it opened, so the client
keeps a pool of `--core-streams` streams on a round_robin channel with health checking, and
sends each request on the stream with the fewest open requests (a slower core holds more, so it
gets fewer). A stream takes new requests for `--core-stream-max-age` seconds, then is retired
(half-closed once its requests ended) and a fresh one opened, so a core that joins or returns
gets streams without a gateway restart. A request with a hash key (a WebSocket session id) goes
on the session channel instead (ring_hash on a request header, gRFC A76): one stream per hash
bucket, the bucket in the stream's metadata, so every request of a session reaches the core
that holds it, or the next one on the ring when that core is gone (a fresh start there).

With `--routing prefix` (gateways.common.prefix_route), a request without a hash key goes to
the core its leading part (or its LoRA adapter's name) hashes to on a consistent-hash ring with
bounded loads, so requests that share a prefix meet the core that caches it, and requests for
an adapter the cores that hold it resident. The client then keeps one channel per core
(the listed addresses, or what a `dns:` name resolves to, looked up again every
`--core-stream-max-age` seconds) with its own small pool of streams, and counts each core's
requests in flight itself. A core without MultiplexGenerate gets its Generate calls by the same
choice; unary calls stay on the balanced channel.

A request that ends with UNAVAILABLE or RESOURCE_EXHAUSTED before its first message (refused
by a draining or full core, or on a stream that broke before it started) is sent again, up to
`--core-retries` times, on another stream (another core); one that had started ends with the
stream's status, which each schema renders in-band. With a single core nothing is resent: there
is no other core, and a broken stream fails every request on it. A stream whose status grpc lost
(LOST_STATUS) has its requests that had not started resent once, with one core or several.

Lives on the aiohttp app (`CORE_CLIENT_KEY`) for the app's lifetime (`core_client_ctx`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import socket
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from gateways.common.adapter_admin import CoreReply, load_verdict, merged_listing, undo_failed, unload_error
from gateways.common.config import GatewayConfig
from gateways.common.core_call import CoreCall
from gateways.common.multiplexed import MultiplexedStream
from gateways.common.prefix_route import (
    DEFAULT_ADAPTER_LOAD_FACTOR,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_PREFIX_CHARS,
    HashRing,
    adapter_key,
    adapter_tiers,
    pick,
    prefix_key,
    requested_adapter,
)
from gateways.common.status import GatewayError
from gateways.common.targets import (
    HASH_HEADER,
    CoreTarget,
    address_target,
    balanced_service_config,
    dns_name,
    enable_request_hash_header,
    listed_addresses,
    parse_core_target,
    session_service_config,
)
from gateways.common.tenant import current_tenant
from gateways.common.tls import channel_credentials
from gateways.common.tracing import TRACING_KEY, GatewayTracing
from oteltrace import TRACEPARENT, traceparent_of

log = logging.getLogger(__name__)


#: Status codes of a refusal that another core may not give (before the request's first message).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

#: The status grpc.aio reads when it lost a stream's own: the server ended the stream while the
#: client was writing to it (`_AioCall.set_internal_error`, grpc 1.85
#: src/python/grpcio/grpc/_cython/_cygrpc/aio/call.pyx.pxi). About 1 in 100 MultiplexGenerate
#: streams to a core without that method read it instead of UNIMPLEMENTED (measured on loopback).
LOST_STATUS = "Internal error from Core"

#: Seconds a stream opened before its channel was READY takes new requests (see CoreClient._open).
PROVISIONAL_AGE = 1.0

#: Hash buckets of the session channel: one stream per bucket in use, placed by ring_hash.
SESSION_BUCKETS = 64

#: Seconds the requests on the streams of a core that left a dns: name may still run.
CLOSE_GRACE = 600.0


def session_bucket(hash_key: str) -> int:
    """The session channel's hash bucket of a hash key (CRC-32 mod SESSION_BUCKETS: the same
    in every gateway process)."""
    return zlib.crc32(hash_key.encode()) % SESSION_BUCKETS


async def _resolve(host: str, port: int, purpose: str) -> list[str]:
    """The distinct `host:port` of every address `host` resolves to now ([] when the lookup
    fails, logged with its `purpose`)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("looking up %s for %s failed: %s", host, purpose, e)
        return []
    addresses = []
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in addresses:
            addresses.append(address)
    return addresses


#: The request-routing policies of `--routing`.
ROUTINGS = ("round_robin", "prefix")

#: Channel states in which a core takes no request (unreachable, or not SERVING to the health
#: check of its round_robin channel).
_DOWN = frozenset({grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN})


class _Core:
    """One core of `--routing prefix`: its channel and its own pool of streams.

    Args:
        address: the core's host:port (its name on the ring).
        channel: a round_robin channel with health checking to that address only.
        streams: streams in its pool.
    """

    def __init__(self, address: str, channel: grpc.aio.Channel, streams: int):
        self.address = address
        self.channel = channel
        self.stub = spb_grpc.GenerateServiceStub(channel)
        self.pool: list[MultiplexedStream | None] = [None] * streams
        self.streams: set[MultiplexedStream] = set()  # the pool's and retired ones still open
        self.calls = 0  # Generate calls in flight (a core without MultiplexGenerate)
        # The LoRA adapters it holds as far as this gateway knows: the last `max_loras` distinct
        # ones sent there, least recently used first (the HF engine evicts in that order).
        self.adapters: collections.OrderedDict[str, None] = collections.OrderedDict()

    def sent(self, adapter: str, slots: int) -> None:
        """Note a request for `adapter` sent to the core, which holds `slots` adapters at once."""
        self.adapters[adapter] = None
        self.adapters.move_to_end(adapter)
        while len(self.adapters) > slots:
            self.adapters.popitem(last=False)

    def load(self) -> int:
        """Requests of this gateway in flight on the core."""
        return self.calls + sum(len(s.open) for s in self.streams)

    def usable(self) -> bool:
        """Whether the core may take a request (connecting counts: a refusal is retried)."""
        return self.channel.get_state(try_to_connect=True) not in _DOWN


class CoreClient:
    """Calls into the cores' GenerateService.

    Args:
        target: `--core` (gateways.common.targets.parse_core_target), or a parsed CoreTarget.
        max_message_bytes: gRPC message size limit.
        timeout: per-request deadline in seconds (None: no deadline); a request past it ends
            with DEADLINE_EXCEEDED and is cancelled at the core.
        queue_timeout: seconds a request may wait in the core's queue before it is scheduled
            (None: no limit); past it, it ends with DEADLINE_EXCEEDED (reason QUEUE_TIMEOUT) and
            is cancelled at the core.
        api_key: sent as `authorization: Bearer <key>` metadata on every call (the core's
            --api-key); empty: none.
        credentials: TLS channel credentials (gateways.common.tls.channel_credentials); None: a
            plaintext channel.
        streams: MultiplexGenerate streams in the pool (0: auto, see GatewayConfig.core_streams).
        stream_max_age: seconds a stream takes new requests (0: forever).
        retries: times a refused request is resent (used with several cores only).
        reconnect_backoff_ms, max_reconnect_backoff_ms: gRPC's reconnection backoff bounds.
        routing: how a request without a hash key picks its core when there are several:
            "round_robin" (the least-loaded stream of the balanced pool) or "prefix" (a
            consistent hash of its leading part with bounded loads, gateways.common.prefix_route).
        prefix_chars: characters of a text prompt that make its prefix key.
        load_factor: the `c` of bounded loads (at least 1).
        adapter_load_factor: the same for a request naming a LoRA adapter (at least 1).
        tracing: the gateway's tracer (gateways.common.tracing): each request carries its span
            to the core; None: tracing is off.

    Raises:
        ValueError: a `target` that does not parse, an unknown `routing`, a `load_factor` below
            1 or `prefix_chars` below 1.
    """

    def __init__(
        self,
        target: str | CoreTarget,
        *,
        max_message_bytes: int = 16 * 1024 * 1024,
        timeout: float | None = None,
        streams: int = 0,
        stream_max_age: float = 30.0,
        retries: int = 2,
        reconnect_backoff_ms: int = 100,
        max_reconnect_backoff_ms: int = 500,
        queue_timeout: float | None = None,
        api_key: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        routing: str = "round_robin",
        prefix_chars: int = DEFAULT_PREFIX_CHARS,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        adapter_load_factor: float = DEFAULT_ADAPTER_LOAD_FACTOR,
        tracing: GatewayTracing | None = None,
    ):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if load_factor < 1 or adapter_load_factor < 1:
            raise ValueError(
                f"the routing load factors must be at least 1, got {load_factor} and {adapter_load_factor}"
            )
        if prefix_chars < 1:
            raise ValueError(f"the routing prefix length must be at least 1 character, got {prefix_chars}")
        self.target = parse_core_target(target) if isinstance(target, str) else target
        self.address = self.target.uri
        self.tracing = tracing
        self.timeout = timeout
        self.queue_timeout = queue_timeout
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._credentials = credentials
        several = self.target.several
        self.retries = retries if several else 0
        self.stream_max_age = stream_max_age
        size = streams or (max(4, 2 * self.target.addresses) if several else 1)
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A core that comes back is reconnected to within max_reconnect_backoff_ms, whatever
            # the length of the outage (grpc's defaults: 1 s growing to 120 s).
            ("grpc.initial_reconnect_backoff_ms", max(1, reconnect_backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", max(1, reconnect_backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms),
            # Balancing comes from this config only, never from DNS TXT records.
            ("grpc.service_config_disable_resolution", 1),
        ]
        self._channel = self._make_channel([*options, ("grpc.service_config", balanced_service_config())])
        self.stub = spb_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session_channel: grpc.aio.Channel | None = None
        if several:
            enable_request_hash_header()
            self._session_channel = self._make_channel([*options, ("grpc.service_config", session_service_config())])
            self._session_stub = spb_grpc.GenerateServiceStub(self._session_channel)
        self._model_info: spb.GetModelInfoResponse | None = None
        self._info_lookup: asyncio.Task[None] | None = None
        # The served model's names once its info is cached (a `model` naming anything else
        # names an adapter, for --routing prefix); None before.
        self._base_names: frozenset[str] | None = None
        self._pool: list[MultiplexedStream | None] = [None] * size
        self._sessions: dict[int, MultiplexedStream] = {}
        self._turn = itertools.count()
        self._multiplex = True  # False once the core answered UNIMPLEMENTED
        self._closing = False
        self._draining = False
        self._unary: set[asyncio.Task[None]] = set()
        self._delivering = False  # a stream reader is handing out one core message's news
        self._after: list[Callable[[], None]] = []
        # --routing prefix: the cores by address, their ring, and the lookup of a dns: name.
        self.routing = routing if several else "round_robin"
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self.adapter_load_factor = adapter_load_factor
        self._options = options
        self._per_core = max(1, math.ceil(size / max(1, self.target.addresses)))
        self._cores: list[_Core] = []
        self._ring: HashRing | None = None
        self._dns = dns_name(self.target) if self.routing == "prefix" else None
        self._lookup: asyncio.Task[None] | None = None
        self._closing_channels: set[asyncio.Task[None]] = set()
        # Adapter management's channel per core, when routing keeps none (gateways.common.adapter_admin).
        self._management_stubs: dict[str, Any] = {}
        self._management_channels: list[grpc.aio.Channel] = []
        if self.routing == "prefix":
            listed = listed_addresses(self.target)
            if listed is None and self._dns is None:
                raise ValueError(
                    f"--routing prefix needs the cores' addresses: a list, an ipv4:/ipv6: target or a dns: name, "
                    f"not {self.target.uri!r}"
                )
            if listed is not None:
                self.set_cores(listed)

    def set_cores(self, addresses: list[str]) -> None:
        """The cores of `--routing prefix` (their ring), keeping the channels and streams of
        the cores still listed; the streams of a core no longer listed are retired and its
        channel closes once their requests ended."""
        addresses = sorted(set(addresses))
        if not addresses or [c.address for c in self._cores] == addresses:
            return
        old = {c.address: c for c in self._cores}
        cores = []
        for address in addresses:
            core = old.pop(address, None)
            if core is None:
                channel = self._make_channel(
                    [*self._options, ("grpc.service_config", balanced_service_config())], address_target(address)
                )
                core = _Core(address, channel, self._per_core)
            cores.append(core)
        for core in old.values():
            for s in core.pool:
                if s is not None:
                    s.retire()
            # The retired streams end once their requests have; close() refuses new calls and
            # cancels what still runs after the grace.
            task = asyncio.get_running_loop().create_task(core.channel.close(grace=CLOSE_GRACE))
            self._closing_channels.add(task)
            task.add_done_callback(self._closing_channels.discard)
        self._cores = cores
        self._ring = HashRing(addresses)
        log.info("prefix routing over %d cores: %s", len(cores), ", ".join(addresses))

    async def _look_up(self) -> None:
        """Resolve the dns: name of `--routing prefix` now and every stream max age (30 s when
        streams never expire); a failed lookup keeps the cores known."""
        assert self._dns is not None
        while not self._closing:
            addresses = await _resolve(*self._dns, "prefix routing")
            if addresses:
                self.set_cores(addresses)
            await asyncio.sleep(self.stream_max_age or 30.0)

    def after_news(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once, after the news being handed out now: right after a stream's reader
        has given every request its part of the current core message (one engine step's news
        of every request on that stream), or on the event loop's next turn when no message is
        being handed out (news from a timer, a Generate call, a refusal). A listener that
        collects several requests' news into one write (a WebSocket) sends it from there: one
        write per step, with no loop callback per write. `fn` must not raise (it is logged)."""
        if self._delivering:
            self._after.append(fn)
        else:
            asyncio.get_running_loop().call_soon(fn)

    def _delivered(self) -> None:
        self._delivering = False
        after, self._after = self._after, []
        for fn in after:
            try:
                fn()
            except Exception:
                log.exception("a callback after the core's news failed")

    def _make_channel(self, options: list[tuple[str, Any]], uri: str | None = None) -> grpc.aio.Channel:
        """A channel to the target (or `uri`), over TLS when the client has credentials."""
        uri = uri or self.target.uri
        if self._credentials is None:
            return grpc.aio.insecure_channel(uri, options=options)
        return grpc.aio.secure_channel(uri, self._credentials, options=options)

    def connect(self) -> None:
        """Start connecting to every core now (the channels are idle until then)."""
        self._channel.get_state(try_to_connect=True)
        if self._session_channel is not None:
            self._session_channel.get_state(try_to_connect=True)
        for core in self._cores:
            core.channel.get_state(try_to_connect=True)
        if self._dns is not None and self._lookup is None:
            self._lookup = asyncio.get_running_loop().create_task(self._look_up())
        if self.tracing is not None:
            self._learn_model()

    def _learn_model(self) -> None:
        """Look the model info up in the background (spans name the served model of requests
        that name none), unless it is known or being looked up; a failure is retried by the
        next traced request."""
        if self._model_info is not None or (self._info_lookup is not None and not self._info_lookup.done()):
            return

        async def look_up() -> None:
            with contextlib.suppress(GatewayError):
                await self.model_info()

        self._info_lookup = asyncio.get_running_loop().create_task(look_up())

    async def close(self) -> None:
        """Close the channels (open requests end with UNAVAILABLE)."""
        self._closing = True
        await self._channel.close()
        if self._session_channel is not None:
            await self._session_channel.close()
        if self._lookup is not None:
            self._lookup.cancel()
        if self._info_lookup is not None:
            self._info_lookup.cancel()
        for core in self._cores:
            await core.channel.close()
        for channel in self._management_channels:
            await channel.close()
        for task in [*self._unary, *self._closing_channels]:
            task.cancel()

    def generate(
        self,
        request: spb.GenerateRequest,
        *,
        hash_key: str | None = None,
        steps: bool = False,
        span: trace.Span | None = None,
    ) -> CoreCall:
        """Start a Generate request; cancel its CoreCall (in a `finally`) when giving it up.

        Every schema served renders token records (ids, token text, bytes) only with logprobs,
        so a request without logprobs and without an explicit `output.tokens` is sent with
        `output.tokens` false: text-only responses cross the wire as text. A request without a
        tenant is sent for the tenant of the HTTP request being served (gateways.common.tenant).

        Args:
            request: the request (not modified).
            hash_key: what should keep requests on the same core (a session id), if anything.
            steps: the caller renders plain decode steps from their values (core_call.Step:
                text, token id, logprob), reading nothing else of their tokens, so they arrive
                so (MultiplexStart.steps); a per-request Generate call sends whole messages.
            span: with tracing on, the span the request serves (default: the current one, the
                HTTP request's); the core's spans of it become its children.
        """
        tenant = current_tenant()
        text_only = not request.output.logprobs and not request.output.HasField("tokens")
        if text_only or (tenant and not request.tenant):
            sent = spb.GenerateRequest()
            sent.CopyFrom(request)
            if text_only:
                sent.output.tokens = False
            if tenant and not request.tenant:
                sent.tenant = tenant
            request = sent
        call = CoreCall(request, steps=steps and self._multiplex, hash_key=hash_key)
        if self.tracing is not None:
            span = span or trace.get_current_span()
            if span.get_span_context().is_valid:
                call.span = span
                info = self._model_info
                if info is None:
                    self._learn_model()
                model = request.model or (info.model_name if info is not None else "")
                if model:
                    span.set_attribute("gen_ai.request.model", model)
        if self._multiplex:
            self._stream_for(hash_key, request=request).start(call)
        else:
            self._relay_unary(call)
        if self.timeout:
            call._set_deadline(self.timeout)
        if self.queue_timeout:
            call._set_queue_deadline(self.queue_timeout)
        return call

    def _stream_for(
        self,
        hash_key: str | None,
        avoid: MultiplexedStream | None = None,
        request: spb.GenerateRequest | None = None,
    ) -> MultiplexedStream:
        """The stream a request goes on: its session bucket's (with a hash key and several
        cores); with `--routing prefix` and the cores known, a stream of the core `request`'s
        routing key picks (its adapter, preferring a core that holds it, else its prefix; not
        `avoid`'s core while another is usable); else the pool's stream with the fewest open
        requests, other than `avoid`."""
        now = time.monotonic()
        if hash_key is not None and self._session_channel is not None:
            bucket = session_bucket(hash_key)
            stream = self._sessions.get(bucket)
            if stream is None or stream.broken or now > stream.expires:
                if stream is not None:
                    stream.retire()
                stream = self._sessions[bucket] = self._open(
                    self._session_stub, self._session_channel, ((HASH_HEADER, str(bucket)),)
                )
            return stream
        if self._ring is not None and request is not None:
            core = self._route(self._ring, request, avoid.core if avoid is not None else None)
            stream = self._least_loaded(core.pool, core.stub, core.channel, avoid, now, provisional=False)
            stream.core = core.address
            core.streams.add(stream)
            return stream
        return self._least_loaded(self._pool, self.stub, self._channel, avoid, now)

    def _route(self, ring: HashRing, request: spb.GenerateRequest, avoid: str | None = None) -> _Core:
        """The core of `--routing prefix` that `request` goes to, whether on a stream or in a
        Generate call: by its adapter (preferring a core that holds it), else by its prefix;
        not the core at address `avoid` while another is usable."""
        cores = self._cores
        avoided = next((i for i, c in enumerate(cores) if c.address == avoid), None)
        loads, usable = [c.load() for c in cores], [c.usable() for c in cores]
        name = requested_adapter(request, self._base_names)
        if name:
            slots = self._model_info.max_loras if self._model_info is not None else 0
            tiers = adapter_tiers(name, [c.adapters for c in cores], slots)
            i = pick(ring, adapter_key(name), loads, usable, self.adapter_load_factor, avoided, tiers)
            cores[i].sent(name, slots)
        else:
            i = pick(ring, prefix_key(request, self.prefix_chars), loads, usable, self.load_factor, avoided)
        return cores[i]

    def _least_loaded(
        self,
        pool: list[MultiplexedStream | None],
        stub: Any,
        channel: grpc.aio.Channel,
        avoid: MultiplexedStream | None,
        now: float,
        provisional: bool = True,
    ) -> MultiplexedStream:
        """The stream of `pool` with the fewest open requests, other than `avoid`, opened on
        `stub` in a free place; an expired stream is retired and a broken one replaced on the
        way."""
        offset = next(self._turn)
        best = -1
        for k in range(len(pool)):
            i = (offset + k) % len(pool)
            stream = pool[i]
            if stream is not None and (stream.broken or now > stream.expires):
                stream.retire()
                stream = pool[i] = None
            if stream is None:
                best = i
                break
            if stream is avoid:
                continue
            if best < 0 or len(stream.open) < len(cast(MultiplexedStream, pool[best]).open):
                best = i
        if best < 0:  # a pool of one, to be avoided: open another stream
            best = offset % len(pool)
            cast(MultiplexedStream, pool[best]).retire()
            pool[best] = None
        stream = pool[best]
        if stream is None:
            stream = pool[best] = self._open(stub, channel, provisional=provisional)
        return stream

    def _open(
        self,
        stub: Any,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...] = (),
        provisional: bool = True,
    ) -> MultiplexedStream:
        """A new stream, with its expiry: --core-stream-max-age, or at most PROVISIONAL_AGE when
        the channel is not READY yet and `provisional` (a channel over several cores). A stream
        opened while the channel connects goes to the first core that answers (the balancer's
        picker holds only the cores connected when it is picked), so with several cores it is
        replaced soon, once all of them had time."""
        stream = MultiplexedStream(self, stub, metadata)
        age = self.stream_max_age or float("inf")
        if provisional and self.target.several and channel.get_state() is not grpc.ChannelConnectivity.READY:
            age = min(age, PROVISIONAL_AGE)
        stream.expires = time.monotonic() + age
        return stream

    def _retry(self, call: CoreCall, error: GatewayError, failed: MultiplexedStream) -> bool:
        """Resend `call` (refused with `error` before its first message on stream `failed`) on
        another stream, when retries are left; False when it must end with `error`. A stream
        whose status grpc lost (LOST_STATUS) resends its requests once even with one core."""
        lost = error.code is grpc.StatusCode.INTERNAL and error.message == LOST_STATUS
        retries = max(self.retries, 1) if lost else self.retries
        if self._closing or call.ended or call.attempts > retries or not (lost or error.code in RETRYABLE):
            return False
        call.attempts += 1
        log.info(
            "request %s refused (%s: %s); resending it (attempt %d)",
            call.request.request_id,
            error.code.name,
            error.message,
            call.attempts,
        )
        # A session's stream that broke reopens where the ring now points; a refusal by a live
        # core (full, draining) goes to the pool, whose least-loaded stream is on another core.
        if failed.broken and call.hash_key is not None:
            self._stream_for(call.hash_key).start(call)
        else:
            self._stream_for(None, avoid=failed, request=call.request).start(call)
        return True

    def _closed(self, stream: MultiplexedStream) -> None:
        for i, s in enumerate(self._pool):
            if s is stream:
                self._pool[i] = None
        for bucket, s in list(self._sessions.items()):
            if s is stream:
                del self._sessions[bucket]
        for core in self._cores:
            core.streams.discard(stream)
            for i, s in enumerate(core.pool):
                if s is stream:
                    core.pool[i] = None

    def _fallback(self, call: CoreCall) -> None:
        """Serve a request refused by a core without MultiplexGenerate with a Generate call
        (whole messages only: its deltas are never steps)."""
        if self._multiplex:
            log.warning("the core at %s has no MultiplexGenerate; using one Generate call per request", self.address)
        self._multiplex = False
        call.steps = False
        self._relay_unary(call)

    def _relay_unary(self, call: CoreCall) -> None:
        """Serve `call` with one Generate call, routed as on a stream: with a hash key on the
        session channel (its bucket in the call's metadata), else on the core `--routing
        prefix` picks (counted in its load while it runs), else on the balanced channel."""
        stub, metadata, core = self.stub, self.metadata, None
        if call.hash_key is not None and self._session_channel is not None:
            bucket = session_bucket(call.hash_key)
            stub, metadata = self._session_stub, (*self.metadata, (HASH_HEADER, str(bucket)))
        elif self._ring is not None:
            core = self._route(self._ring, call.request)
            stub = core.stub
        if call.span is not None:
            metadata = (*metadata, (TRACEPARENT, traceparent_of(call.span)))
        grpc_call = stub.Generate(call.request, metadata=metadata or None)
        call._cancel = lambda: grpc_call.cancel() and None
        if core is not None:
            core.calls += 1

        async def relay() -> None:
            try:
                async for msg in grpc_call:
                    call._news((msg,), False, None)
                call._news((), True, None)
            except grpc.RpcError as e:
                call._news((), True, GatewayError.from_rpc_error(e))
            except asyncio.CancelledError:
                grpc_call.cancel()
            finally:
                if core is not None:
                    core.calls -= 1

        task = asyncio.create_task(relay())
        self._unary.add(task)
        task.add_done_callback(self._unary.discard)

    async def model_info(self) -> spb.GetModelInfoResponse:
        """The served model's info (cached after the first success).

        Raises:
            GatewayError: the core cannot be reached (UNAVAILABLE) or fails.
        """
        if self._model_info is None:
            try:
                info = await self.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=10, metadata=self.metadata)
                self._model_info = cast(spb.GetModelInfoResponse, info)
                self._base_names = frozenset((info.model_name, *info.model_aliases))
            except grpc.RpcError as e:
                raise GatewayError.from_rpc_error(e) from None
        return self._model_info

    async def tokenize(self, request: spb.TokenizeRequest) -> spb.TokenizeResponse:
        """The core's Tokenize: the token ids Generate would see for a text or a chat (one
        unary call on the balanced channel, with the request deadline).

        Raises:
            GatewayError: the core's refusal (INVALID_ARGUMENT naming the field), or the core
                cannot be reached (UNAVAILABLE).
        """
        try:
            reply = await self.stub.Tokenize(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise GatewayError.from_rpc_error(e) from None
        return cast(spb.TokenizeResponse, reply)

    async def list_adapters(self) -> spb.ListAdaptersResponse:
        """The adapters of every core (not cached: adapters come and go at run time): their
        union by name (gateways.common.adapter_admin.merged_listing).

        Raises:
            GatewayError: a core's refusal, or no core can be reached (UNAVAILABLE).
        """
        replies = await self._each_core("ListAdapters", spb.ListAdaptersRequest(), 10.0)
        return merged_listing(replies)

    async def load_adapter(self, name: str, path: str) -> spb.LoadAdapterResponse:
        """LoadAdapter on every core the gateway knows; it stands when every reachable core
        registered the adapter, else it is unregistered again from those that did
        (gateways.common.adapter_admin, docs/lora.md "Several cores").

        Returns:
            a core's answer (the adapter as registered).

        Raises:
            GatewayError: the refusal (FAILED_PRECONDITION: management off; NOT_FOUND,
                INVALID_ARGUMENT naming "name" or "path"; ALREADY_EXISTS), as the core gave it
                when every core gave it, else naming each core and what it said; UNAVAILABLE
                when no core can be reached.
        """
        targets = await self._management_targets()
        request = spb.LoadAdapterRequest(name=name, path=path)
        replies = await self._each_core("LoadAdapter", request, self.timeout or 60.0, targets)
        same_path: frozenset[str] = frozenset()
        exists = [r.address for r in replies if r.error is not None and r.error.code is grpc.StatusCode.ALREADY_EXISTS]
        if exists and any(r.error is None for r in replies):
            listings = await self._each_core(
                "ListAdapters", spb.ListAdaptersRequest(), 10.0, [t for t in targets if t[0] in exists]
            )
            same_path = frozenset(
                r.address
                for r in listings
                if r.value is not None and any(a.name == name and a.path == path for a in r.value.adapters)
            )
        verdict = load_verdict(name, replies, same_path)
        if verdict.error is None:
            assert verdict.reply is not None
            return verdict.reply
        error = verdict.error
        if verdict.undo:
            undone = await self._each_core(
                "UnloadAdapter", spb.UnloadAdapterRequest(name=name), 10.0, [t for t in targets if t[0] in verdict.undo]
            )
            error = undo_failed(error, undone)
        raise error

    async def unload_adapter(self, name: str) -> None:
        """UnloadAdapter on every core the gateway knows; it stands when a core unregistered
        the adapter and none refused (gateways.common.adapter_admin).

        Raises:
            GatewayError: the refusal (FAILED_PRECONDITION: management off), naming the cores
                when they differ; NOT_FOUND when no reachable core holds it; UNAVAILABLE when
                no core can be reached.
        """
        replies = await self._each_core("UnloadAdapter", spb.UnloadAdapterRequest(name=name), 10.0)
        error = unload_error(name, replies)
        if error is not None:
            raise error

    async def _management_targets(self) -> list[tuple[str, Any]]:
        """(address, stub) of every core management calls reach: the cores of `--routing
        prefix`, else each address the target lists or its `dns:` name resolves to now (a
        channel of its own per core), else the balanced channel (a target whose cores only
        grpc's resolver knows, or a single address)."""
        if self._cores:
            return [(c.address, c.stub) for c in self._cores]
        addresses = listed_addresses(self.target)
        if addresses is None:
            try:
                dns = dns_name(self.target)
            except ValueError:
                dns = None
            if dns is not None:
                addresses = await _resolve(*dns, "adapter management")
        if not addresses or len(addresses) == 1:
            return [(self.address, self.stub)]
        targets = []
        for address in addresses:
            stub = self._management_stubs.get(address)
            if stub is None:
                channel = self._make_channel(
                    [*self._options, ("grpc.service_config", balanced_service_config())], address_target(address)
                )
                self._management_channels.append(channel)
                stub = self._management_stubs[address] = spb_grpc.GenerateServiceStub(channel)
            targets.append((address, stub))
        return targets

    async def _each_core(
        self, method: str, request: Any, deadline_s: float, targets: list[tuple[str, Any]] | None = None
    ) -> list[CoreReply[Any]]:
        """Call `method` with `request` on every core of `targets` (default: every core
        management reaches) at once, each call with a deadline of `deadline_s` seconds; one
        CoreReply per core, in their order."""
        if targets is None:
            targets = await self._management_targets()

        async def call(address: str, stub: Any) -> CoreReply[Any]:
            try:
                reply = await getattr(stub, method)(request, timeout=deadline_s, metadata=self.metadata)
            except grpc.RpcError as e:
                return CoreReply(address, error=GatewayError.from_rpc_error(e))
            return CoreReply(address, value=reply)

        return list(await asyncio.gather(*(call(address, stub) for address, stub in targets)))

    def drain(self) -> None:
        """The gateway stops (gateways.common.drain): `serving()` is False from now on."""
        self._draining = True

    async def serving(self) -> bool:
        """Whether the gateway takes requests: not draining, and a core answers grpc.health.v1
        Check with SERVING (within 2 s)."""
        if self._draining:
            return False
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
        queue_timeout=config.queue_timeout or None,
        api_key=config.core_api_key,
        credentials=channel_credentials(config),
        streams=config.core_streams,
        stream_max_age=config.core_stream_max_age,
        retries=config.core_retries,
        reconnect_backoff_ms=config.core_reconnect_backoff_ms,
        max_reconnect_backoff_ms=config.core_max_reconnect_backoff_ms,
        routing=config.routing,
        prefix_chars=config.routing_prefix_chars,
        load_factor=config.routing_load_factor,
        adapter_load_factor=config.routing_adapter_load_factor,
        tracing=app.get(TRACING_KEY),
    )
    client.connect()
    app[CORE_CLIENT_KEY] = client
    yield
    await client.close()
