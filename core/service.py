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
from core.config import CoreConfig
from core.errors import CoreError, EngineFailure, InvalidArgument, NotReady
from core.multiplex import CallOutput, MultiplexSession
from core.pipeline import RequestPipeline, merge_deltas
from core.types import GUIDE_KINDS, EngineInfo, SamplingOptions
from core.validation import validate_request
from core.wire import Malformed

log = logging.getLogger(__name__)


class GenerateServicer(spb_grpc.GenerateServiceServicer):
    """Serves Generate, GetModelInfo and Tokenize for one pipeline.

    `drain()` is called on graceful shutdown: new requests then fail with UNAVAILABLE.
    """

    def __init__(self, pipeline: RequestPipeline, config: CoreConfig):
        self.pipeline = pipeline
        self.config = config
        self.draining = False
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
        in flight (flow control: the client reads slower) goes out merged (merge_deltas)."""
        request_id = (None if isinstance(request, Malformed) else request.request_id) or uuid.uuid4().hex
        error: CoreError | None = None
        out = CallOutput()
        job = None
        self._generate_calls += 1
        self._idle.clear()
        try:
            if isinstance(request, Malformed):
                raise request.error("Generate")
            if self.draining:
                raise NotReady("The server is shutting down; retry on another replica.")
            req = convert.to_generation_request(request, request_id)
            job = self.pipeline.start(await self.pipeline.prepare_off_loop(req), out)
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
            log.info("request %s: %s %s", request_id, error.code.name, error.message)
            await context.abort_with_status(error.to_status())

    async def MultiplexGenerate(
        self,
        request_iterator: AsyncIterator[spb.MultiplexGenerateRequest | Malformed],
        context: grpc.aio.ServicerContext[spb.MultiplexGenerateRequest, spb.MultiplexGenerateResponse],
    ) -> None:
        """Many requests on one stream, for gateways (see core.multiplex)."""
        session = MultiplexSession(self.pipeline, context, draining=self.draining)
        self._sessions.add(session)
        self._idle.clear()
        try:
            await session.serve(request_iterator)
        finally:
            self._sessions.discard(session)
            self._check_idle()

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
        )

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
        spans = self.pipeline.tokenizer.spans(req.text or "", ids) if which == "text" else []
        return spb.TokenizeResponse(
            token_ids=ids,
            rendered_prompt=rendered,
            spans=[spb.TokenSpan(start=start, stop=stop) for start, stop in spans],
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
