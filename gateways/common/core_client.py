"""The gateway's connection to the core: one grpc.aio channel, Generate requests multiplexed on
a MultiplexGenerate stream, cached model info, health.

`CoreClient.generate(request)` starts a request and returns its `CoreCall`: the core's
GenerateResponse messages as they arrive, then the request's end (OK, or a GatewayError). All
requests share one MultiplexGenerate stream on the channel: the core sends one message per
engine step with the news of every request, and a reader task hands each request's messages to
its CoreCall in one pass, which passes them on synchronously to a listener (the relay that
writes the HTTP response, the WebSocket connection) or wakes the one coroutine waiting on it.
A broken stream (the core went away) ends every request open on it with the stream's status;
the next request opens a new stream. A core without MultiplexGenerate (UNIMPLEMENTED) is served
with one Generate call per request instead, the requests waiting on the refused stream
included.

Which stream a request goes on is this module's business alone (`_stream_for`, with the
request's hash key, e.g. a WebSocket session id), so that routing over several cores can be
added here without touching the gateways.

Lives on the aiohttp app (`CORE_CLIENT_KEY`) for the app's lifetime (`core_client_ctx`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, cast

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from gateways.common.config import GatewayConfig
from gateways.common.status import DEADLINE_PASSED, GatewayError
from gateways.common.tls import channel_credentials

log = logging.getLogger(__name__)


class CoreCall:
    """One Generate request as the gateway sees it.

    The transport feeds it (`_news`); its owner either waits (`wait()`, then `take()`) or
    registers a listener (`listen(fn)`), called synchronously every time news arrive: new
    messages to `take()`, or the end (`ended`, with `error` None for OK). A listener must not
    raise (the reader task logs it and cancels the request).

    Attributes:
        request: the request as sent.
        ended: the request ended (after its messages), failed or was cancelled.
        error: why it ended, when not OK.
    """

    __slots__ = ("_cancel", "_listener", "_messages", "_queue_timer", "_timer", "_waiter", "ended", "error", "request")

    def __init__(self, request: spb.GenerateRequest, cancel: Callable[[], None]):
        self.request = request
        self.ended = False
        self.error: GatewayError | None = None
        self._messages: list[spb.GenerateResponse] = []
        self._cancel = cancel
        self._listener: Callable[[], None] | None = None
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
        self._listener = listener
        if self._messages or self.ended:
            listener()

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

    def _news(self, messages: Iterable[spb.GenerateResponse], ended: bool, error: GatewayError | None) -> None:
        """Transport side: more messages, and maybe the end."""
        if self.ended:
            return
        if self._queue_timer is not None:
            messages = list(messages)
            if any(m.state >= pb.GENERATE_STATE_SCHEDULED or m.outputs for m in messages):
                self._queue_timer.cancel()
                self._queue_timer = None
        self._messages.extend(messages)
        if ended:
            self._finish(error)
        if self._listener is not None:
            self._listener()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _finish(self, error: GatewayError | None) -> None:
        self.ended = True
        self.error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None


class _Multiplexed:
    """One MultiplexGenerate stream and the requests open on it (see the module docstring)."""

    def __init__(self, client: CoreClient):
        self.client = client
        self.call = cast(Any, client.stub.MultiplexGenerate(metadata=client.metadata))
        self.open: dict[int, CoreCall] = {}
        self.broken = False
        self._ids = itertools.count(1)
        self._starts: list[spb.MultiplexStart] = []
        self._cancels: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def start(self, request: spb.GenerateRequest) -> CoreCall:
        rid = next(self._ids)
        call = CoreCall(request, lambda: self._cancel(rid))
        self.open[rid] = call
        start = spb.MultiplexStart(id=rid)
        start.request.CopyFrom(request)
        self._starts.append(start)
        self._wake()
        return call

    def _cancel(self, rid: int) -> None:
        if self.open.pop(rid, None) is not None and not self.broken:
            self._cancels.append(rid)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _write(self) -> None:
        """Send what waits to be started or cancelled, as one message each time."""
        try:
            while True:
                if not (self._starts or self._cancels):
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
                for ev in msg.events:
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
                    try:
                        call._news(ev.responses, ended, err)
                    except Exception:
                        log.exception("request %s: rendering failed", call.request.request_id)
                        call.cancel()
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
                else:
                    call._news((), True, error)


class CoreClient:
    """Calls into the core's GenerateService.

    Args:
        address: host:port of the core.
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
    """

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int = 16 * 1024 * 1024,
        timeout: float | None = None,
        queue_timeout: float | None = None,
        api_key: str = "",
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.queue_timeout = queue_timeout
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = spb_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._model_info: spb.GetModelInfoResponse | None = None
        self._stream: _Multiplexed | None = None
        self._multiplex = True  # False once the core answered UNIMPLEMENTED
        self._unary: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Close the channel (open requests end with UNAVAILABLE)."""
        await self._channel.close()
        for task in list(self._unary):
            task.cancel()

    def generate(self, request: spb.GenerateRequest, *, hash_key: str | None = None) -> CoreCall:
        """Start a Generate request; cancel its CoreCall (in a `finally`) when giving it up.

        Every schema served renders token records (ids, token text, bytes) only with logprobs,
        so a request without logprobs and without an explicit `output.tokens` is sent with
        `output.tokens` false: text-only responses cross the wire as text.

        Args:
            request: the request (not modified).
            hash_key: what should keep requests on the same core (a session id), if anything.
        """
        if not request.output.logprobs and not request.output.HasField("tokens"):
            sent = spb.GenerateRequest()
            sent.CopyFrom(request)
            sent.output.tokens = False
            request = sent
        if self._multiplex:
            call = self._stream_for(hash_key).start(request)
        else:
            call = self._start_unary(request)
        if self.timeout:
            call._set_deadline(self.timeout)
        if self.queue_timeout:
            call._set_queue_deadline(self.queue_timeout)
        return call

    def _stream_for(self, hash_key: str | None) -> _Multiplexed:
        """The stream a request goes on (one per client: there is one core)."""
        if self._stream is None or self._stream.broken:
            self._stream = _Multiplexed(self)
        return self._stream

    def _closed(self, stream: _Multiplexed) -> None:
        if self._stream is stream:
            self._stream = None

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
        queue_timeout=config.queue_timeout or None,
        api_key=config.core_api_key,
        credentials=channel_credentials(config),
    )
    app[CORE_CLIENT_KEY] = client
    yield
    await client.close()
