"""The gateway's connection to its cores: grpc.aio channels balanced by grpcio, Generate
requests multiplexed on a pool of MultiplexGenerate streams, cached model info, health.

`CoreClient.generate(request)` starts a request and returns its `CoreCall`: the core's
GenerateResponse messages as they arrive, then the request's end (OK, or a GatewayError). Many
requests share one MultiplexGenerate stream: the core sends one message per engine step with the
news of every request on it, and a reader task hands each request's messages to its CoreCall in
one pass, which passes them on synchronously to a listener (the relay that writes the HTTP
response, the WebSocket connection) or wakes the one coroutine waiting on it. Most messages of a
plain text stream arrive as text alone (TextSteps, or MultiplexEvent.texts), and so do the
ordinary tokens of a request that reads only their ids and logprobs (`generate(...,
compact_tokens=True)`, with their token_ids): a listener that renders from those takes them as
they are (`listen_texts`); for everyone else they become the GenerateResponse each stands for
(`text_response`). A core without MultiplexGenerate (UNIMPLEMENTED) is served with one
Generate call per request instead, the requests waiting on the refused stream included.

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

A request that ends with UNAVAILABLE or RESOURCE_EXHAUSTED before its first message (refused
by a draining or full core, or on a stream that broke before it started) is sent again, up to
`--core-retries` times, on another stream (another core); one that had started ends with the
stream's status, which each schema renders in-band. With a single core nothing is resent: there
is no other core, and a broken stream fails every request on it as before.

Lives on the aiohttp app (`CORE_CLIENT_KEY`) for the app's lifetime (`core_client_ctx`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from gateways.common.config import GatewayConfig
from gateways.common.status import DEADLINE_PASSED, GatewayError
from gateways.common.targets import (
    HASH_HEADER,
    CoreTarget,
    balanced_service_config,
    enable_request_hash_header,
    parse_core_target,
    session_service_config,
)
from gateways.common.tls import channel_credentials

log = logging.getLogger(__name__)

_NAN = float("nan")


class CoreCall:
    """One Generate request as the gateway sees it.

    The transport feeds it (`_news`, `_text_news`, `_entry_news`); its owner either waits
    (`wait()`, then `take()`) or registers a listener (`listen(fn)`), called synchronously every
    time news arrive: new messages to `take()`, or the end (`ended`, with `error` None for OK),
    and may also take text-only (and compact token) messages as they arrive (`listen_texts`). A
    listener must not raise (the reader task logs it and cancels the request).

    Attributes:
        request: the request as sent.
        request_id: the request's id in the core's messages (the core's own for a request
            sent without one).
        ended: the request ended (after its messages), failed or was cancelled.
        error: why it ended, when not OK.
        started: a message of it arrived.
        attempts: times it was sent (a refused request is resent to another core).
        hash_key: what keeps it on its session's core, if anything.
        compact_tokens: its tokens may arrive in compact form (MultiplexStart.compact_tokens).
    """

    __slots__ = (
        "_cancel",
        "_entry_listener",
        "_listener",
        "_messages",
        "_queue_timer",
        "_text_listener",
        "_timer",
        "_waiter",
        "attempts",
        "compact_tokens",
        "ended",
        "error",
        "hash_key",
        "request",
        "request_id",
        "started",
    )

    def __init__(self, request: spb.GenerateRequest, cancel: Callable[[], None]):
        self.request = request
        self.request_id = request.request_id
        self.ended = False
        self.started = False  # a message arrived: the request can no longer be resent
        self.attempts = 1
        self.hash_key: str | None = None
        self.compact_tokens = False
        self.error: GatewayError | None = None
        self._messages: list[spb.GenerateResponse] = []
        self._cancel = cancel
        self._listener: Callable[[], None] | None = None
        self._text_listener: TextListener | None = None
        self._entry_listener: EntryListener | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queue_timer: asyncio.TimerHandle | None = None

    def take(self) -> list[spb.GenerateResponse]:
        """The messages received since the last take, in order."""
        messages, self._messages = self._messages, []
        return messages

    async def wait(self) -> None:
        """Return once a message waits or the request ended."""
        while not self._messages and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever news arrive (now, if some wait already)."""
        if not self.ended:  # an ended call keeps no listener (see _finish)
            self._listener = listener
        if self._messages or self.ended:
            listener()

    def listen_texts(self, listener: TextListener, entry: EntryListener | None = None) -> None:
        """Call `listener(texts, token_ids, logprobs)` for text-only and compact token
        messages (entry i stands for `text_response(request_id, texts[i], token_ids[i],
        logprobs[i])`, token_ids and logprobs empty when the messages have no token or no
        logprob; in order with the other messages) instead of handing them to `take()`; with
        `listen()`, whose listener has taken every message before. `entry(text, token_id,
        logprob)`, when given, takes a core message's one entry of the request instead (most
        steps), without a sequence built for it (token_id and logprob None when absent)."""
        if not self.ended:
            self._text_listener = listener
            self._entry_listener = entry

    def cancel(self) -> None:
        """Give the request up: the core aborts it within an engine step (no-op once ended)."""
        if not self.ended:
            self._finish(GatewayError(grpc.StatusCode.CANCELLED, "The request was cancelled."))
            self._cancel()

    def _set_deadline(self, seconds: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self.ended:
            self._cancel()
            self._news((), True, GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_PASSED))

    def _set_queue_deadline(self, seconds: float) -> None:
        self._queue_timer = asyncio.get_running_loop().call_later(seconds, self._queue_expired, seconds)

    def _queue_expired(self, seconds: float) -> None:
        self._queue_timer = None
        if not self.ended:
            self._cancel()
            message = (
                f"The request waited more than {seconds:g} s (--queue-timeout) for a place in the running batch; "
                "retry later."
            )
            self._news((), True, GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, message, reason="QUEUE_TIMEOUT"))

    def _news(self, messages: Sequence[spb.GenerateResponse], ended: bool, error: GatewayError | None) -> None:
        """Transport side: more messages (a tuple, or an event's repeated field as it is: no
        copy per token), and maybe the end."""
        if self.ended:
            return
        if messages:
            if not self.started:
                self.request_id = messages[0].request_id
            if self._queue_timer is not None and any(
                m.state >= pb.GENERATE_STATE_SCHEDULED or m.outputs for m in messages
            ):
                self._queue_timer.cancel()
                self._queue_timer = None
            self._messages.extend(messages)
            self.started = True
        listener = self._listener
        if ended:
            self._finish(error)
        if listener is not None:
            listener()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _text_news(self, texts: Sequence[str], token_ids: Sequence[int] = (), logprobs: Sequence[float] = ()) -> None:
        """Transport side: text-only or compact token messages (entries of TextSteps or of
        MultiplexEvent.texts, with their token_ids and logprobs), to the text listener when
        there is one, else as the GenerateResponses they stand for."""
        if self.ended:
            return
        if self._text_listener is not None and not self._messages:
            self._text_listener(texts, token_ids, logprobs)
        else:
            rid, none = self.request_id, [None] * len(texts)
            parts = zip(texts, token_ids or none, logprobs or none, strict=True)
            self._news([text_response(rid, text, tok, lp) for text, tok, lp in parts], False, None)

    def _entry_news(self, text: str, token_id: int | None, logprob: float | None) -> None:
        """Transport side: `_text_news` of one entry, to the entry listener when there is one."""
        if self.ended:
            return
        if self._entry_listener is not None and not self._messages:
            self._entry_listener(text, token_id, logprob)
        else:
            self._text_news((text,), () if token_id is None else (token_id,), () if logprob is None else (logprob,))

    def _finish(self, error: GatewayError | None) -> None:
        self.ended = True
        self.error = error
        # A listener is a closure that holds its request's stream, and so this call: dropped
        # here, a request's objects go when its handler returns, not in the garbage
        # collector's next full pass (every few seconds under load, and 0.1 s long).
        self._listener = self._text_listener = self._entry_listener = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None


#: `CoreCall.listen_texts`'s listener: (texts, token_ids, logprobs) of one request's entries.
TextListener = Callable[[Sequence[str], Sequence[int], Sequence[float]], None]

#: `CoreCall.listen_texts`'s entry listener: (text, token_id, logprob) of one entry, None for
#: an absent token or logprob.
EntryListener = Callable[[str, int | None, float | None], None]


def text_response(
    request_id: str, text: str, token_id: int | None = None, logprob: float | None = None
) -> spb.GenerateResponse:
    """The GenerateResponse a TextSteps (or MultiplexEvent.texts) entry stands for: new text of
    sequence 0 and, for a compact token (token_ids), its one token {id, logprob}
    (generate_service.proto)."""
    response = spb.GenerateResponse(request_id=request_id)
    out = response.outputs.add()
    out.text = text
    if token_id is not None:
        tok = out.tokens.add()
        tok.id = token_id
        if logprob is not None:
            tok.logprob = logprob
    return response


def _give_texts(call: CoreCall, texts: Sequence[str], token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
    """Hand `call` its text entries (of TextSteps, or of an event's `texts`); token_ids and
    logprobs are the entries' columns (empty when there are none; in TextSteps -1 and NaN
    stand for none, and a request's entries all have one or none). A failing listener
    cancels the request only."""
    try:
        if not token_ids or token_ids[0] < 0:
            call._text_news(texts)
        elif logprobs and logprobs[0] == logprobs[0]:  # not NaN
            call._text_news(texts, token_ids, logprobs)
        else:
            call._text_news(texts, token_ids)
    except Exception:
        _rendering_failed(call)


def _rendering_failed(call: CoreCall) -> None:
    log.exception("request %s: rendering failed", call.request.request_id)
    call.cancel()


class _Multiplexed:
    """One MultiplexGenerate stream and the requests open on it (see the module docstring).

    Args:
        client: the owner.
        stub: the stub of the channel the stream opens on.
        metadata: the stream's metadata (the session channel's hash header).
    """

    def __init__(self, client: CoreClient, stub: Any, metadata: tuple[tuple[str, str], ...] = ()):
        self.client = client
        self.call = cast(Any, stub.MultiplexGenerate(metadata=(*client.metadata, *metadata) or None))
        self.open: dict[int, CoreCall] = {}
        self.broken = False
        self.retired = False  # takes no new request; half-closed once `open` is empty
        self.expires = float("inf")  # monotonic time after which it takes no new request
        self._ids = itertools.count(1)
        self._starts: list[spb.MultiplexStart] = []
        self._cancels: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def start(self, call: CoreCall) -> None:
        """Send `call`'s request on this stream."""
        rid = next(self._ids)
        call._cancel = lambda: self._cancel(rid)
        self.open[rid] = call
        start = spb.MultiplexStart(id=rid, compact_tokens=call.compact_tokens)
        start.request.CopyFrom(call.request)
        self._starts.append(start)
        self._wake()

    def retire(self) -> None:
        """Take no new request; end the stream once the open ones ended."""
        self.retired = True
        self._wake()

    def _cancel(self, rid: int) -> None:
        if self.open.pop(rid, None) is not None and not self.broken:
            self._cancels.append(rid)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _write(self) -> None:
        """Send what waits to be started or cancelled, as one message each time; half-close a
        retired stream once nothing is open."""
        try:
            while True:
                if not (self._starts or self._cancels):
                    if self.retired and not self.open:
                        await self.call.done_writing()
                        return
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                    continue
                msg = spb.MultiplexGenerateRequest(starts=self._starts, cancels=self._cancels)
                self._starts, self._cancels = [], []
                await self.call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream failed: the reader reports it to the requests
            log.debug("multiplexed stream write failed: %s", e)

    def _end(self, call: CoreCall, error: GatewayError | None) -> None:
        """A request's end: resent elsewhere when it was refused before it started."""
        if error is not None and self.client._retry(call, error, self):
            return
        call._news((), True, error)

    @staticmethod
    def _take_steps(steps: spb.TextSteps, open_calls: dict[int, CoreCall]) -> None:
        """Hand each request its entries of a message's TextSteps (generate_service.proto), as
        an event's `texts`, `token_ids` and `logprobs`: several entries of one request (a
        request behind, whose steps the core sent together) in one call."""
        ids = list(steps.ids)
        texts = list(steps.texts)
        token_ids = list(steps.token_ids)
        logprobs = list(steps.logprobs)
        if len(set(ids)) == len(ids):
            for i, rid in enumerate(ids):
                call = open_calls.get(rid)
                if call is None:
                    continue
                tok = token_ids[i] if token_ids else -1
                lp = logprobs[i] if logprobs else _NAN
                try:
                    call._entry_news(texts[i], None if tok < 0 else tok, lp if lp == lp else None)  # NaN: none
                except Exception:
                    _rendering_failed(call)
            return
        runs: dict[int, list[int]] = {}
        for i, rid in enumerate(ids):
            runs.setdefault(rid, []).append(i)
        for rid, run in runs.items():
            call = open_calls.get(rid)
            if call is not None:
                tokens = [token_ids[i] for i in run] if token_ids else []
                _give_texts(call, [texts[i] for i in run], tokens, [logprobs[i] for i in run] if logprobs else [])

    def _take_events(self, events: Sequence[spb.MultiplexEvent], open_calls: dict[int, CoreCall]) -> None:
        """Hand each request its events of a message (generate_service.proto): responses, texts,
        and the status that ends it. No call outlives this frame, so an ended request is freed
        at once, not when the stream's next message comes."""
        for ev in events:
            call = open_calls.get(ev.id)
            if call is None:  # cancelled by the gateway: late news
                continue
            ended = ev.HasField("status")
            err = None
            if ended:
                del open_calls[ev.id]
                st = ev.status
                if st.code:
                    err = GatewayError.from_status(st.code, st.message, st.details)
                    if not ev.responses and not call.started:
                        self._end(call, err)
                        continue
            try:
                texts = ev.texts
                if texts:
                    _give_texts(call, texts, ev.token_ids, ev.logprobs)
                    if not ended and not ev.responses:
                        continue
                call._news(ev.responses, ended, err)
            except Exception:
                _rendering_failed(call)

    async def _read(self) -> None:
        """Hand every event to its request; at the stream's end, end the requests left."""
        error = GatewayError(grpc.StatusCode.UNAVAILABLE, "The model server closed the connection; retry.")
        unimplemented = False
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                open_calls = self.open
                self.client._delivering = True
                try:
                    if msg.HasField("steps"):
                        self._take_steps(msg.steps, open_calls)
                    if msg.events:
                        self._take_events(msg.events, open_calls)
                finally:
                    self.client._delivered()
                if self.retired and not open_calls:
                    self._wake()
        except grpc.RpcError as e:
            unimplemented = e.code() is grpc.StatusCode.UNIMPLEMENTED
            error = GatewayError.from_rpc_error(e)
        except asyncio.CancelledError:
            error = GatewayError(grpc.StatusCode.UNAVAILABLE, "The gateway is shutting down.")
            raise
        finally:
            self.broken = True
            self._writer.cancel()
            self.client._closed(self)
            calls, self.open = list(self.open.values()), {}
            for call in calls:
                if unimplemented:
                    self.client._fallback(call)
                elif call.started:
                    call._news((), True, error)
                else:
                    self._end(call, error)


#: Status codes of a refusal that another core may not give (before the request's first message).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

#: Seconds a stream opened before its channel was READY takes new requests (see CoreClient._open).
PROVISIONAL_AGE = 1.0

#: Hash buckets of the session channel: one stream per bucket in use, placed by ring_hash.
SESSION_BUCKETS = 64


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

    Raises:
        ValueError: a `target` that does not parse.
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
    ):
        self.target = parse_core_target(target) if isinstance(target, str) else target
        self.address = self.target.uri
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
        self._pool: list[_Multiplexed | None] = [None] * size
        self._sessions: dict[int, _Multiplexed] = {}
        self._turn = itertools.count()
        self._multiplex = True  # False once the core answered UNIMPLEMENTED
        self._closing = False
        self._draining = False
        self._unary: set[asyncio.Task[None]] = set()
        self._delivering = False  # a stream reader is handing out one core message's news
        self._after: list[Callable[[], None]] = []

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

    def _make_channel(self, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to the target, over TLS when the client has credentials."""
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target.uri, options=options)
        return grpc.aio.secure_channel(self.target.uri, self._credentials, options=options)

    def connect(self) -> None:
        """Start connecting to every core now (the channels are idle until then)."""
        self._channel.get_state(try_to_connect=True)
        if self._session_channel is not None:
            self._session_channel.get_state(try_to_connect=True)

    async def close(self) -> None:
        """Close the channels (open requests end with UNAVAILABLE)."""
        self._closing = True
        await self._channel.close()
        if self._session_channel is not None:
            await self._session_channel.close()
        for task in list(self._unary):
            task.cancel()

    def generate(
        self, request: spb.GenerateRequest, *, hash_key: str | None = None, compact_tokens: bool = False
    ) -> CoreCall:
        """Start a Generate request; cancel its CoreCall (in a `finally`) when giving it up.

        Every schema served renders token records (ids, token text, bytes) only with logprobs,
        so a request without logprobs and without an explicit `output.tokens` is sent with
        `output.tokens` false: text-only responses cross the wire as text.

        Args:
            request: the request (not modified).
            hash_key: what should keep requests on the same core (a session id), if anything.
            compact_tokens: the caller reads only `id` and `logprob` of generated tokens, so
                they may arrive in compact form (MultiplexStart.compact_tokens; a per-request
                Generate call sends whole tokens, which read the same).
        """
        if not request.output.logprobs and not request.output.HasField("tokens"):
            sent = spb.GenerateRequest()
            sent.CopyFrom(request)
            sent.output.tokens = False
            request = sent
        if self._multiplex:
            call = CoreCall(request, lambda: None)
            call.hash_key = hash_key
            call.compact_tokens = compact_tokens
            self._stream_for(hash_key).start(call)
        else:
            call = self._start_unary(request)
        if self.timeout:
            call._set_deadline(self.timeout)
        if self.queue_timeout:
            call._set_queue_deadline(self.queue_timeout)
        return call

    def _stream_for(self, hash_key: str | None, avoid: _Multiplexed | None = None) -> _Multiplexed:
        """The stream a request goes on: its session bucket's (with a hash key and several
        cores), else the pool's stream with the fewest open requests, other than `avoid`;
        an expired stream is retired and a broken one replaced on the way."""
        now = time.monotonic()
        if hash_key is not None and self._session_channel is not None:
            bucket = zlib.crc32(hash_key.encode()) % SESSION_BUCKETS
            stream = self._sessions.get(bucket)
            if stream is None or stream.broken or now > stream.expires:
                if stream is not None:
                    stream.retire()
                stream = self._sessions[bucket] = self._open(
                    self._session_stub, self._session_channel, ((HASH_HEADER, str(bucket)),)
                )
            return stream
        pool = self._pool
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
            if best < 0 or len(stream.open) < len(cast(_Multiplexed, pool[best]).open):
                best = i
        if best < 0:  # a pool of one, to be avoided: open another stream
            best = offset % len(pool)
            cast(_Multiplexed, pool[best]).retire()
            pool[best] = None
        stream = pool[best]
        if stream is None:
            stream = pool[best] = self._open(self.stub, self._channel)
        return stream

    def _open(self, stub: Any, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> _Multiplexed:
        """A new stream, with its expiry: --core-stream-max-age, or at most PROVISIONAL_AGE when
        the channel is not READY yet. A stream opened while the channel connects goes to the
        first core that answers (the balancer's picker holds only the cores connected when it
        is picked), so with several cores it is replaced soon, once all of them had time."""
        stream = _Multiplexed(self, stub, metadata)
        age = self.stream_max_age or float("inf")
        if self.target.several and channel.get_state() is not grpc.ChannelConnectivity.READY:
            age = min(age, PROVISIONAL_AGE)
        stream.expires = time.monotonic() + age
        return stream

    def _retry(self, call: CoreCall, error: GatewayError, failed: _Multiplexed) -> bool:
        """Resend `call` (refused with `error` before its first message on stream `failed`) on
        another stream, when retries are left; False when it must end with `error`."""
        if self._closing or error.code not in RETRYABLE or call.attempts > self.retries or call.ended:
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
        if failed.broken and failed in self._sessions.values():
            self._stream_for(call.hash_key).start(call)
        else:
            self._stream_for(None, avoid=failed).start(call)
        return True

    def _closed(self, stream: _Multiplexed) -> None:
        for i, s in enumerate(self._pool):
            if s is stream:
                self._pool[i] = None
        for bucket, s in list(self._sessions.items()):
            if s is stream:
                del self._sessions[bucket]

    def _fallback(self, call: CoreCall) -> None:
        """Serve a request refused by a core without MultiplexGenerate with a Generate call."""
        if self._multiplex:
            log.warning("the core at %s has no MultiplexGenerate; using one Generate call per request", self.address)
        self._multiplex = False
        self._relay_unary(call)

    def _start_unary(self, request: spb.GenerateRequest) -> CoreCall:
        call = CoreCall(request, lambda: None)
        self._relay_unary(call)
        return call

    def _relay_unary(self, call: CoreCall) -> None:
        grpc_call = self.stub.Generate(call.request, metadata=self.metadata)
        call._cancel = lambda: grpc_call.cancel() and None

        async def relay() -> None:
            try:
                async for msg in grpc_call:
                    call._news((msg,), False, None)
                call._news((), True, None)
            except grpc.RpcError as e:
                call._news((), True, GatewayError.from_rpc_error(e))
            except asyncio.CancelledError:
                grpc_call.cancel()

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
            except grpc.RpcError as e:
                raise GatewayError.from_rpc_error(e) from None
        return self._model_info

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
    )
    client.connect()
    app[CORE_CLIENT_KEY] = client
    yield
    await client.close()
