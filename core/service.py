"""GenerateService servicer: thin glue between gRPC and the request pipeline.

Generate: convert -> prepare (validation, tokenization) -> start a pipeline Job -> stream its
deltas as GenerateResponses. MultiplexGenerate: the same for many requests on one stream
(core.multiplex). Errors become gRPC statuses with google.rpc details (CoreError.to_status);
an unexpected exception is logged with the request id and reported as INTERNAL. A cancelled
call propagates CancelledError through the pipeline, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core import convert
from core.auth import caller_identity
from core.config import CoreConfig
from core.errors import CoreError, EngineFailure, InvalidArgument, ManagementDisabled, NotReady
from core.lora import AdapterStatus, ServesAdapters, lora_of, read_spec, unknown_adapter
from core.multiplex import CallOutput, MultiplexSession, StreamBounds
from core.pipeline import RequestPipeline, merge_deltas
from core.tracing import CoreTracing, traceparent_metadata
from core.types import GUIDE_KINDS, EngineInfo, SamplingOptions
from core.validation import validate_request
from core.wire import Malformed
from envflags.apikeys import ApiKeys

log = logging.getLogger(__name__)


class GenerateServicer(spb_grpc.GenerateServiceServicer):
    """Serves Generate, GetModelInfo and Tokenize for one pipeline.

    `drain()` is called on graceful shutdown: new requests then fail with UNAVAILABLE.
    With `keys` that have names (`--api-key name:key`), a call's requests are served for the
    tenant its key names, whatever their `tenant` field says (core.tenants). With `tracing`,
    every request's spans are exported (core.tracing), continuing the call's `traceparent`
    metadata or the request's `trace_context`.
    """

    def __init__(
        self,
        pipeline: RequestPipeline,
        config: CoreConfig,
        keys: ApiKeys | None = None,
        tracing: CoreTracing | None = None,
    ):
        self.pipeline = pipeline
        self.tracing = tracing
        self.config = config
        self._keys = keys if keys is not None and keys.named else None
        self.draining = False
        self.bounds = StreamBounds(config.max_queued_messages_per_stream, config.slow_reader_timeout)
        self._sessions: set[MultiplexSession] = set()
        self._generate_calls = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def Generate(
        self,
        request: spb.GenerateRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.GenerateRequest, spb.GenerateResponse],
    ) -> AsyncIterator[spb.GenerateResponse]:
        """Stream one request's GenerateResponses; a failure ends the call with its CoreError's
        status (before the first message for validation and admission errors).

        One message per engine step while the client keeps up; what waits while a write is
        in flight (flow control: the client reads slower) goes out merged (merge_deltas), within
        `self.bounds` (beyond: RESOURCE_EXHAUSTED, reason SLOW_READER; core.multiplex)."""
        request_id = (None if isinstance(request, Malformed) else request.request_id) or uuid.uuid4().hex
        error: CoreError | None = None
        out = CallOutput(self.bounds)
        job = None
        req = None
        trace = None
        if self.tracing is not None:
            sent = "" if isinstance(request, Malformed) else request.trace_context
            trace = self.tracing.begin(sent or traceparent_metadata(context.invocation_metadata()))
        self._generate_calls += 1
        self._idle.clear()
        try:
            if isinstance(request, Malformed):
                raise request.error("Generate")
            if self.draining:
                raise NotReady("The server is shutting down; retry on another replica.")
            req = convert.to_generation_request(request, request_id, self._caller(context), self.key_tenant(context))
            job = self.pipeline.start(await self.pipeline.prepare_off_loop(req), out, trace=trace)
            while True:
                for delta in merge_deltas(await out.take()):
                    yield convert.to_response(delta, request_id)
                if out.ended and not out.pending:
                    break
            error = out.error
        except CoreError as e:
            error = e
        except Exception:  # a bug, not a client error (a cancelled call raises CancelledError, not this)
            log.exception("request %s failed", request_id)
            error = EngineFailure(f"Internal error while serving request {request_id}; see the server log.")
        finally:
            self._generate_calls -= 1
            self._check_idle()
            if job is not None:
                job.cancel()
        if error is not None:
            if trace is not None and job is None:
                trace.refused(error, req)
            log.info("request %s: %s %s", request_id, error.code.name, error.message)
            await context.abort_with_status(error.to_status())

    async def MultiplexGenerate(
        self,
        request_iterator: AsyncIterator[spb.MultiplexGenerateRequest | Malformed],
        context: grpc.aio.ServicerContext[spb.MultiplexGenerateRequest, spb.MultiplexGenerateResponse],
    ) -> None:
        """Many requests on one stream, for gateways (see core.multiplex)."""
        session = MultiplexSession(
            self.pipeline,
            context,
            draining=self.draining,
            bounds=self.bounds,
            caller=self._caller(context),
            tenant=self.key_tenant(context),
            tracing=self.tracing,
        )
        self._sessions.add(session)
        self._idle.clear()
        try:
            await session.serve(request_iterator)
        finally:
            self._sessions.discard(session)
            self._check_idle()

    def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The identity of the call's API key when the core has keys (it scopes sessions), else ""."""
        return caller_identity(context.invocation_metadata()) if self.config.api_key else ""

    def key_tenant(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The name of the call's API key, when keys have names and this one has; else None
        (the requests' own `tenant` fields apply). The interceptor (core.auth) has already
        accepted the key."""
        if self._keys is None:
            return None
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        return self._keys.name_of(values[0]) if len(values) == 1 and isinstance(values[0], str) else None

    def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE); open ones run on, and multiplexed streams end as
        soon as they have none open."""
        self.draining = True
        for session in list(self._sessions):
            session.drain()

    async def wait_idle(self) -> None:
        """Return once no Generate call and no MultiplexGenerate stream is open."""
        await self._idle.wait()

    def _check_idle(self) -> None:
        if not self._generate_calls and not self._sessions:
            self._idle.set()

    async def GetModelInfo(
        self,
        request: spb.GetModelInfoRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.GetModelInfoRequest, spb.GetModelInfoResponse],
    ) -> spb.GetModelInfoResponse:
        """The served model, the limits validation applies, and the engine's sampling defaults."""
        if isinstance(request, Malformed):
            await _refuse(context, request.error("GetModelInfo"))
        p, cfg = self.pipeline, self.config
        info = p.engine.info
        greedy = p.engine.resolve_sampling(SamplingOptions(do_sample=False), random_seed=0)
        sampling = p.engine.resolve_sampling(SamplingOptions(do_sample=True), random_seed=0)
        greedy_pb, sampling_pb = convert.to_sampling_params(greedy), convert.to_sampling_params(sampling)
        greedy_pb.ClearField("seed")
        sampling_pb.ClearField("seed")
        return spb.GetModelInfoResponse(
            model_name=cfg.served_model_name,
            model_aliases=cfg.model_aliases,
            model_version=cfg.model_version,
            engine=info.engine,
            max_context_length=info.max_context_length,
            max_new_tokens=p.limits.max_new_tokens,
            default_max_new_tokens=cfg.default_max_new_tokens,
            vocab_size=info.vocab_size,
            has_chat_template=p.tokenizer.has_chat_template,
            accepts_images=False,
            max_num_beams=info.max_num_beams,
            max_top_logprobs=info.max_top_logprobs,
            max_stop_sequences=p.limits.max_stop_sequences,
            greedy_defaults=greedy_pb,
            sampling_defaults=sampling_pb,
            unsupported_sampling_fields=sorted(info.unsupported_sampling_fields),
            max_n=p.limits.max_n,
            guided_decoding=[k for k in GUIDE_KINDS if k in info.guided_decoding],
            max_input_tokens=_max_input_tokens(info),
            adapters=self._adapter_infos(),
            max_loras=lora.max_loras if (lora := lora_of(p.engine)) is not None else 0,
        )

    def _adapter_infos(self) -> list[spb.AdapterInfo]:
        lora = lora_of(self.pipeline.engine)
        return [] if lora is None else [_adapter_info(s) for s in lora.adapters()]

    async def ListAdapters(
        self,
        request: spb.ListAdaptersRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.ListAdaptersRequest, spb.ListAdaptersResponse],
    ) -> spb.ListAdaptersResponse:
        """The registered LoRA adapters (none when the engine serves none)."""
        if isinstance(request, Malformed):
            await _refuse(context, request.error("ListAdapters"))
        lora = lora_of(self.pipeline.engine)
        return spb.ListAdaptersResponse(adapters=self._adapter_infos(), max_loras=0 if lora is None else lora.max_loras)

    async def LoadAdapter(
        self,
        request: spb.LoadAdapterRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.LoadAdapterRequest, spb.LoadAdapterResponse],
    ) -> spb.LoadAdapterResponse:
        """Register a PEFT adapter at run time (see the RPC's comment in the proto for each
        refusal); requests running meanwhile go on, the weights being read off the loop."""
        if isinstance(request, Malformed):
            await _refuse(context, request.error("LoadAdapter"))
        try:
            lora = self._managed()
            if not request.path:
                raise InvalidArgument("Set path: the adapter's directory.", field="path")
            cfg = self.config
            spec = read_spec(
                request.name,
                request.path,
                max_rank=cfg.max_lora_rank,
                model_path=cfg.model,
                served_model=cfg.served_model_name,
            )
            await lora.load_adapter(spec)
        except CoreError as e:
            await _refuse(context, e)
        log.info("adapter %s loaded from %s", spec.name, spec.path)
        status = next((s for s in lora.adapters() if s.spec.name == spec.name), AdapterStatus(spec))
        return spb.LoadAdapterResponse(adapter=_adapter_info(status))

    async def UnloadAdapter(
        self,
        request: spb.UnloadAdapterRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.UnloadAdapterRequest, spb.UnloadAdapterResponse],
    ) -> spb.UnloadAdapterResponse:
        """Unregister an adapter; requests running with it finish with it."""
        if isinstance(request, Malformed):
            await _refuse(context, request.error("UnloadAdapter"))
        try:
            lora = self._managed()
            if not lora.has_adapter(request.name):
                raise unknown_adapter(request.name)
            await lora.unload_adapter(request.name)
        except CoreError as e:
            await _refuse(context, e)
        log.info("adapter %s unloaded", request.name)
        return spb.UnloadAdapterResponse()

    def _managed(self) -> ServesAdapters:
        """The engine's adapters, when adapter management is allowed.

        Raises:
            ManagementDisabled: the core runs without --enable-lora-management.
            NotReady: draining, or the engine serves no adapters (--max-loras 0, TensorRT-LLM).
        """
        if not self.config.enable_lora_management:
            raise ManagementDisabled(
                "Loading and unloading adapters is off on this server (start it with --enable-lora-management)."
            )
        if self.draining:
            raise NotReady("The server is shutting down; retry on another replica.")
        lora = lora_of(self.pipeline.engine)
        if lora is None:
            raise ManagementDisabled("This engine serves no LoRA adapters (--max-loras 0, or an engine without them).")
        return lora

    async def Tokenize(
        self,
        request: spb.TokenizeRequest | Malformed,
        context: grpc.aio.ServicerContext[spb.TokenizeRequest, spb.TokenizeResponse],
    ) -> spb.TokenizeResponse:
        """The token ids Generate would see for the same input, after the same input checks
        (INVALID_ARGUMENT naming the field, e.g. an image part or a model without a chat
        template); for text input also each token's byte span in the text."""
        if isinstance(request, Malformed):
            await _refuse(context, request.error("Tokenize"))
        which = request.WhichOneof("input")
        try:
            if which is None:
                raise InvalidArgument("Set text or messages.", field="text")
            if which == "messages":
                body = spb.GenerateRequest(messages=request.messages)
            else:
                body = spb.GenerateRequest(text=request.text)
            req = convert.to_generation_request(body, "tokenize")
            validate_request(req, self.pipeline.limits)
            ids, rendered = self.pipeline.tokenize(req.text, req.messages, req.tools, req.template)
        except CoreError as e:
            await context.abort_with_status(e.to_status())
        p = self.pipeline
        spans = p.tokenizer.spans(req.text or "", ids, split_special=p.split_special) if which == "text" else []
        return spb.TokenizeResponse(
            token_ids=ids,
            rendered_prompt=rendered,
            spans=[spb.TokenSpan(start=start, stop=stop) for start, stop in spans],
        )


def _adapter_info(status: AdapterStatus) -> spb.AdapterInfo:
    s = status.spec
    return spb.AdapterInfo(
        name=s.name,
        path=s.path,
        rank=s.rank,
        resident=status.resident,
        running=status.running,
        waiting=status.waiting,
    )


def _max_input_tokens(info: EngineInfo) -> int:
    """The longest prompt, in tokens, that core.validation.resolve_max_new_tokens lets through:
    the engine's input limit, within the context less the one token left for generation."""
    longest = info.max_context_length - 1
    return longest if info.max_input_length is None else min(info.max_input_length, longest)


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], error: CoreError) -> NoReturn:
    """End the call with `error` (one log line)."""
    log.info("%s %s", error.code.name, error.message)
    await context.abort_with_status(error.to_status())
