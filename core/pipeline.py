"""The request pipeline shared by every engine: everything between a validated request and
token-level engine I/O.

`prepare()` turns a GenerationRequest into an EngineRequest: chat templating with the model's
own template, tokenization, continue-generation sessions, truncation, length checks, default
resolution (the engine's) and the engine-support check. `start()` submits it to the engine as a
Job, which turns the engine's token outputs into ResponseDeltas for a Consumer as they arrive,
with no task per request: the engine hands a step's outputs to the event loop in one callback,
and every request with news is processed in it. A Job does: lifecycle states in order (QUEUED,
SCHEDULED, PREFILLED, GENERATING, filling in what an engine cannot observe), incremental
UTF-8-safe detokenization, stop strings with hold-back, stop tokens, min_new_tokens, time
limits, logprobs with text and bytes, echo, prompt logprobs, best_of selection, usage and
timing. The pipeline never sees protobuf; core.convert renders its deltas, and
`merge_deltas` coalesces the deltas that wait for a slow consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from core.detokenize import ByteDetokenizer, Detokenizer, IncrementalDetokenizer
from core.engine.base import Engine, OutputStream
from core.errors import CoreError, EngineFailure, InvalidArgument, Overloaded, SessionBusy
from core.guided import check_compiles
from core.lora import lora_of, unknown_adapter
from core.metrics import RequestMetrics
from core.sessions import SessionStore, session_key
from core.stops import StopMatcher
from core.tenants import Tenants
from core.tokenizer import Tokenizer
from core.types import (
    DEFAULT_TEMPLATE,
    ChatMessage,
    ChatTemplateOptions,
    EngineOutput,
    EngineRequest,
    FinalInfo,
    FinishReason,
    GenerationRequest,
    PromptTokenInfo,
    RequestState,
    ResolvedSampling,
    ResponseDelta,
    SequenceDelta,
    SequenceStep,
    Timing,
    TokenInfo,
    Tool,
    TopToken,
    Usage,
)
from core.validation import (
    Limits,
    resolve_max_new_tokens,
    tail_for_truncation,
    validate_engine_support,
    validate_request,
)
from logclip import clip

if TYPE_CHECKING:
    from core.tracing import RequestTrace

log = logging.getLogger(__name__)

# Engines key requests by an id of their own, so two clients choosing the same request_id (the
# contract only echoes it) never collide inside an engine.
_ENGINE_IDS = itertools.count()

#: Prompts longer than this (characters) are tokenized on the tokenizer thread (prepare_off_loop).
OFF_LOOP_CHARS = 4096
#: Chats of more messages than this render their template on the tokenizer thread too.
OFF_LOOP_MESSAGES = 64

#: The thread long prompts are tokenized on (see prepare_off_loop).
_TOKENIZER_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

_STATE_ORDER = (RequestState.QUEUED, RequestState.SCHEDULED, RequestState.PREFILLED, RequestState.GENERATING)


@dataclass(slots=True)
class PreparedRequest:
    """A request ready to run: its engine request plus what the pipeline needs for output."""

    request: GenerationRequest
    engine_request: EngineRequest
    sampling: ResolvedSampling
    n: int
    stops: tuple[str, ...]
    include_stop: bool
    skip_special: bool
    spaces_between: bool
    echo: bool
    deadline: float | None
    session_key: str | None = None
    session_previous: list[int] | None = None
    session_continued: bool = False


@dataclass(slots=True)
class _Sequence:
    """Per-sequence output state while streaming."""

    index: int
    detok: Detokenizer
    matcher: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    generated: int = 0
    cumulative_logprob: float = 0.0
    finished: FinishReason | None = None
    text_parts: list[str] = field(default_factory=list)  # kept only when best_of buffers output
    tokens: list[TokenInfo] = field(default_factory=list)  # likewise
    stop_sequence: str = ""
    stop_token_id: int | None = None


class RequestPipeline:
    """Prepares and runs requests against one engine.

    Args:
        engine: the started engine.
        tokenizer: the served model's tokenizer.
        sessions: the continue-generation store.
        limits: configured and engine limits.
        default_max_new_tokens: used when a request leaves max_new_tokens unset.
        allow_special_tokens_in_content: tokenize special-token text in prompts and in the
            client's strings of a chat as those special tokens (--allow-special-tokens-in-content);
            by default it is ordinary text (core.tokenizer's module docstring).
        tenants: per-tenant limits and counts (core.tenants); None: no limits.
        by_priority: requests keep their priority (`--scheduling-policy priority`); else the
            engine sees every request at priority 0.

    Attributes:
        metrics: what the Jobs count for Prometheus (core.metrics).
        tenants: per-tenant limits and counts.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        sessions: SessionStore,
        limits: Limits,
        default_max_new_tokens: int,
        *,
        allow_special_tokens_in_content: bool = False,
        tenants: Tenants | None = None,
        by_priority: bool = False,
    ):
        self.engine = engine
        self.by_priority = by_priority
        self.tenants = tenants or Tenants()
        self.tokenizer = tokenizer
        self.sessions = sessions
        self.limits = limits
        self.default_max_new_tokens = default_max_new_tokens
        self.split_special = not allow_special_tokens_in_content
        self.metrics = RequestMetrics()
        self._token_texts: dict[int, str] = {}  # shared by the ByteDetokenizers

    # ------------------------------------------------------------------ prepare

    def tokenize(
        self,
        text: str | None,
        messages: Sequence[ChatMessage] | None,
        tools: Sequence[Tool] = (),
        template: ChatTemplateOptions = DEFAULT_TEMPLATE,
    ) -> tuple[list[int], str]:
        """Token ids of a text prompt or a chat with its tools and template options (and the
        rendered chat text); special-token text from the client is ordinary text unless
        `split_special` is off."""
        if messages is not None:
            rendered, ids = self.tokenizer.render_chat(messages, tools, template, split_special=self.split_special)
            return ids, rendered
        return self.tokenizer.encode(text or "", split_special=self.split_special), ""

    def prepare(self, req: GenerationRequest, prompt_ids: list[int] | None = None) -> PreparedRequest:
        """Validate and tokenize; the caller must then `run()` the result (which releases the
        session it may hold) or call `discard()`.

        Args:
            req: the request.
            prompt_ids: the request's prompt already tokenized (`prompt_ids()`), if it was.

        Raises:
            CoreError: any validation failure, or a busy session.
        """
        req = self.adapter_by_model(req)
        validate_request(req, self.limits)
        previous = None
        key = session_key(req.session_id, req.session_scope) if req.session_id else None
        if key is not None:
            try:
                previous = self.sessions.acquire(key)
            except KeyError:
                raise SessionBusy(
                    f"Session '{clip(req.session_id)}' is in use by another running request.", field="session_id"
                ) from None
        try:
            prepared = self._prepare(req, previous, prompt_ids)
        except BaseException:
            if key is not None:
                self.sessions.release(key, previous)
            raise
        prepared.session_key = key
        prepared.session_previous = previous
        return prepared

    def adapter_by_model(self, req: GenerationRequest) -> GenerationRequest:
        """`req` with its `model` taken as its adapter when `model` names a registered LoRA
        adapter and `adapter` is unset (vLLM's convention: the adapter is chosen by the model
        name, so every gateway's model field selects adapters)."""
        if not req.model or req.adapter or req.model == self.limits.served_model:
            return req
        lora = lora_of(self.engine)
        if lora is None or not lora.has_adapter(req.model):
            return req
        return dataclasses.replace(req, model=None, adapter=req.model)

    def tokenizes_off_loop(self, req: GenerationRequest) -> bool:
        """Whether `prepare_off_loop` would tokenize `req` on the tokenizer thread: a text or
        chat prompt longer than OFF_LOOP_CHARS, or a chat of more than OFF_LOOP_MESSAGES
        messages, with no session to continue."""
        if req.session_id or req.token_ids is not None:
            return False
        if req.text is not None:
            return len(req.text) > OFF_LOOP_CHARS
        if req.messages is None:
            return False
        # Many short messages cost the template as much as one long one.
        return len(req.messages) > OFF_LOOP_MESSAGES or sum(
            len(p.text or "") for m in req.messages for p in m.content
        ) > (OFF_LOOP_CHARS)

    async def prepare_off_loop(self, req: GenerationRequest) -> PreparedRequest:
        """`prepare()`, with a long prompt tokenized on the tokenizer thread, so that the event
        loop streaming every other request is never held by the tokenizer (a 250 KB prompt
        takes ~0.3 s to tokenize; the length bound of `validate_request` refuses longer ones
        first, on the loop, before any tokenization). One thread: long prompts are tokenized
        one at a time, which also bounds the memory they take.

        Raises:
            CoreError: as `prepare()`.
        """
        if not self.tokenizes_off_loop(req):
            return self.prepare(req)
        validate_request(self.adapter_by_model(req), self.limits)
        ids = await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, self.prompt_ids, req)
        return self.prepare(req, ids)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The token ids of a text or chat prompt (only the tail a text prompt's
        truncate_input_tokens keeps; core.validation.tail_for_truncation)."""
        truncate = req.stopping.truncate_input_tokens
        if req.text is not None and truncate is not None:
            return self.tokenize(tail_for_truncation(req.text, truncate, self.tokenizer.max_token_chars), None)[0]
        return self.tokenize(req.text, req.messages, req.tools, req.template)[0]

    def discard(self, prep: PreparedRequest) -> None:
        """Give up a prepared request without running it (restores its session)."""
        if prep.session_key:
            self.sessions.release(prep.session_key, prep.session_previous)

    def _prepare(
        self, req: GenerationRequest, previous: list[int] | None, prompt_ids: list[int] | None
    ) -> PreparedRequest:
        if previous is not None:
            prompt_ids = previous
        elif prompt_ids is not None:
            pass
        elif req.token_ids is not None:
            prompt_ids = list(req.token_ids)
        elif req.text is not None or req.messages is not None:
            prompt_ids = self.prompt_ids(req)
        else:
            raise InvalidArgument(
                f"There is no live session '{clip(req.session_id)}' to continue and the request has no input; "
                "send text, token_ids or messages.",
                field="text",
            )
        if not prompt_ids:
            raise InvalidArgument("The prompt is empty after tokenization.", field="text")
        truncate = req.stopping.truncate_input_tokens
        if truncate is not None and len(prompt_ids) > truncate:
            prompt_ids = prompt_ids[-truncate:]
        max_new = resolve_max_new_tokens(req, len(prompt_ids), self.limits, self.default_max_new_tokens)
        sampling = self.engine.resolve_sampling(req.sampling, random_seed=secrets.randbits(63))
        validate_engine_support(sampling, req, self.engine.info)
        if req.guide is not None:
            check_compiles(req.guide)
        if req.adapter:
            lora = lora_of(self.engine)
            if lora is None or not lora.has_adapter(req.adapter):
                raise unknown_adapter(req.adapter)
        n = req.sampling.n or 1
        best_of = max(req.sampling.best_of or n, n)
        out = req.output
        st = req.stopping
        encode_plain = self.tokenizer.encode
        engine_request = EngineRequest(
            request_id=f"{req.request_id}#{next(_ENGINE_IDS)}",
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_new_tokens=max_new,
            num_sequences=best_of,
            min_new_tokens=st.min_new_tokens or 0,
            stop_token_ids=frozenset(st.stop_token_ids),
            ignore_eos=bool(st.ignore_eos),
            stop_words_ids=[encode_plain(s, add_special_tokens=False) for s in st.stop],
            bad_words_ids=[ids for ids in (encode_plain(w, add_special_tokens=False) for w in req.bad_words) if ids],
            logit_bias=dict(req.logit_bias),
            logprobs=out.logprobs or best_of > n,
            top_logprobs=out.top_logprobs or 0,
            prompt_logprobs=out.prompt_logprobs,
            arrival_time=time.monotonic(),
            guide=req.guide,
            priority=req.priority if self.by_priority else 0,
            tenant=req.tenant,
            adapter=req.adapter,
        )
        return PreparedRequest(
            request=req,
            engine_request=engine_request,
            sampling=sampling,
            n=n,
            stops=st.stop,
            include_stop=bool(st.include_stop_str_in_output),
            skip_special=out.skip_special_tokens is not False,
            spaces_between=out.spaces_between_special_tokens is not False,
            echo=bool(out.echo),
            deadline=(engine_request.arrival_time + st.time_limit_ms / 1000.0) if st.time_limit_ms else None,
            session_continued=previous is not None,
        )

    # ------------------------------------------------------------------ run

    def start(
        self,
        prep: PreparedRequest,
        consumer: Consumer,
        tag: int = 0,
        steps: bool = False,
        trace: RequestTrace | None = None,
    ) -> Job:
        """Submit a prepared request to the engine; its ResponseDeltas go to `consumer` as the
        engine produces them (see Job). Whatever the engine has already put (its QUEUED output)
        is delivered before this returns. `steps`: the consumer takes plain decode steps as
        values (`Consumer.deliver_step`, MultiplexStart.steps). `trace`: the request's spans,
        made when the Job ends (core.tracing; None: not traced).

        Raises:
            CoreError: admission (Overloaded, NotReady, EngineDead, InvalidArgument); the
                request's session is released again.
        """
        job = Job(self, prep, consumer, tag, steps)
        job.trace = trace
        job.start()
        return job

    def _decode_fn(self, prep: PreparedRequest) -> Callable[[Sequence[int]], str]:
        tok, skip, spaces = self.tokenizer, prep.skip_special, prep.spaces_between
        return lambda ids: tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)

    def detokenizer(self, prep: PreparedRequest) -> Detokenizer:
        """The incremental detokenizer of one sequence: byte-exact when the tokenizer allows it
        and no space goes between special tokens, else the windowed one."""
        tok = self.tokenizer
        if tok.byte_exact and (prep.skip_special or not prep.spaces_between):
            return ByteDetokenizer(tok.token_bytes, tok.special_ids if prep.skip_special else (), self._token_texts)
        return IncrementalDetokenizer(self._decode_fn(prep), prep.engine_request.prompt_ids)

    def token_info(self, token_id: int, logprob: float | None, top: Sequence[tuple[int, float]] | None) -> TokenInfo:
        """A TokenInfo with text, raw bytes, special flag, logprob and alternatives."""
        tok = self.tokenizer
        alts = (
            [TopToken(i, tok.token_text(i), tok.token_bytes(i), lp, tok.is_special(i)) for i, lp in top] if top else []
        )
        return TokenInfo(
            token_id, tok.token_text(token_id), tok.token_bytes(token_id), tok.is_special(token_id), logprob, alts
        )


class Consumer(Protocol):
    """Where a Job's output goes (a Generate call, a MultiplexGenerate stream, a test).

    Both methods are called synchronously on the event loop, from the engine's delivery of a
    step (every request with news in one callback), and must not raise. A consumer wakes its
    writer there (a future it awaits): the writer runs once the whole step was processed, so
    it sends the news of every request of the step together.
    """

    def deliver(self, job: Job, deltas: list[ResponseDelta]) -> None:
        """The next ResponseDeltas of `job`, in order (the last has `final` set when it ends)."""

    def deliver_step(self, job: Job, text: str, token_id: int, logprob: float | None) -> None:
        """A plain decode step of `job` (one started with `steps`; see `Job._is_plain_step`):
        what `deliver` would say with `ResponseDelta(sequences=[SequenceDelta(0, text,
        tokens=[token_id's TokenInfo])])` (without the token for a request with
        OutputOptions.tokens false), `logprob` None unless the request asked for logprobs. Only
        the token's id and logprob travel: the consumer reads nothing else of it."""

    def finish(self, job: Job, error: CoreError | None) -> None:
        """`job` ended: None after its final delta, else the error that ends it (before or
        after deltas; the deltas delivered before it stand)."""


class Job:
    """One running request: engine outputs in, ResponseDeltas out (RequestPipeline.start).

    Lifecycle states come in order (QUEUED, SCHEDULED, PREFILLED, GENERATING, filling in
    what an engine cannot observe), text is detokenized incrementally (UTF-8 safe) and held
    back for stop strings, token details are built only when the request asks for tokens,
    the time limit is a timer (no per-token check by the consumer), best_of output is
    buffered and ranked, and the final delta carries usage and timing. The session is stored
    before the final delta is delivered, so a client that continues it on seeing the end
    finds it released.

    `cancel()` (the consumer went away) aborts the engine request, which takes effect within
    one engine step, and keeps the partial sequence in the session.

    Attributes:
        tag: the consumer's key of this job (a MultiplexGenerate id).
        request_id: the client's request id.
        done: no more deliveries will come.
        trace: its spans, made once it ended (core.tracing), or None.
    """

    def __init__(
        self,
        pipeline: RequestPipeline,
        prep: PreparedRequest,
        consumer: Consumer,
        tag: int = 0,
        steps: bool = False,
    ):
        self.p = pipeline
        self.prep = prep
        self.consumer = consumer
        self.tag = tag
        self.request_id = prep.request.request_id
        req = prep.engine_request
        self.seqs = [
            _Sequence(i, pipeline.detokenizer(prep), StopMatcher(prep.stops, prep.include_stop))
            for i in range(req.num_sequences)
        ]
        self.buffered = req.num_sequences > prep.n  # best_of: output only at the end
        self.returned = self.seqs
        self.sent_states = 0
        self.times: dict[RequestState, float] = {}
        self.cached_tokens = 0
        self.unfinished = req.num_sequences
        self.want_tokens = prep.request.output.tokens is not False
        self.want_logprobs = prep.request.output.logprobs
        # Steps can go as values only for one sequence with no alternatives to render, no
        # stop strings to hold text back for and no time limit to check.
        self._steps = (
            steps and req.num_sequences == 1 and not req.top_logprobs and not prep.stops and prep.deadline is None
        )
        self._metrics = pipeline.metrics
        self._special_ids = pipeline.tokenizer.special_ids
        self.done = False
        self.last_token_time = 0.0  # of the last step that gave tokens; 0.0: none yet
        self._itl = pipeline.metrics.itl
        self._stream: OutputStream | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.trace: RequestTrace | None = None

    def start(self) -> None:
        """Submit to the engine (see RequestPipeline.start)."""
        prep = self.prep
        tenant = prep.engine_request.tenant
        try:
            self.p.tenants.admit(tenant, time.monotonic())
        except BaseException:
            self.done = True
            self.p.discard(prep)
            raise
        try:
            self._stream = self.p.engine.generate(prep.engine_request)
        except BaseException as e:
            self.done = True
            self.p.discard(prep)
            self.p.tenants.withdraw(tenant)
            if isinstance(e, Overloaded):
                self.p.metrics.rejected += 1
                self.p.tenants.refused(tenant)
            raise
        if prep.deadline is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + prep.deadline - time.monotonic(), self._expire)
        self._stream.attach(self._on_engine_output)

    def cancel(self, error: CoreError | None = None) -> None:
        """The consumer went away, or gives the request up with `error` (SLOW_READER): abort
        the engine request (no more deliveries)."""
        if self.done:
            return
        self.done = True
        self._stop(failed=False)
        self._count(FinishReason.CANCELLED.value, error)

    def _expire(self) -> None:
        """The time limit is spent while waiting (queued, or a slow step)."""
        self._timer = None
        self._on_engine_output(EngineOutput(self.prep.engine_request.request_id, time=time.monotonic()))

    def _on_engine_output(self, out: EngineOutput) -> None:
        if self.done:
            return
        try:
            if out.error is not None:
                if isinstance(out.error, Overloaded):  # displaced from the full queue
                    self.p.tenants.refused(self.prep.engine_request.tenant)
                raise out.error if isinstance(out.error, CoreError) else EngineFailure(str(out.error))
            if out.preempted:
                self.p.tenants.preempted(self.prep.engine_request.tenant)
                return
            if self._steps and self._is_plain_step(out):
                self._on_decode_step(out, out.sequences[0])
                return
            self._metrics.delta_outputs += 1
            deltas = self._on_output(out)
        except CoreError as e:
            self._end(e)
            return
        except Exception:  # a bug, not the engine: fail this request only
            log.exception("request %s failed in the pipeline", self.request_id)
            self._end(EngineFailure(f"Internal error while serving request {self.request_id}; see the server log."))
            return
        if self.unfinished:
            if deltas:
                self.consumer.deliver(self, deltas)
            return
        self.done = True
        self._stop(failed=False)
        self._count((self.returned[0].finished or FinishReason.CANCELLED).value)
        self.consumer.deliver(self, deltas)
        self.consumer.finish(self, None)

    def _end(self, error: CoreError) -> None:
        self.done = True
        self._stop(failed=True)
        self._count(FinishReason.ERROR.value, error)
        self.consumer.finish(self, error)

    def _count(self, reason: str, error: CoreError | None = None) -> None:
        """Count the ended request for Prometheus (core.metrics), once, and make its spans
        when it is traced."""
        req = self.prep.engine_request
        scheduled = self.times.get(RequestState.SCHEDULED)
        generated = sum(s.generated for s in self.seqs)
        now = time.monotonic()
        self.p.metrics.ended(
            reason,
            len(req.prompt_ids),
            generated,
            None if scheduled is None else scheduled - req.arrival_time,
            now - req.arrival_time,
            req.adapter,
        )
        self.p.tenants.ended(
            req.tenant,
            scheduled=scheduled is not None,
            prompt_tokens=len(req.prompt_ids) if scheduled is not None else 0,
            generation_tokens=generated,
            now=now,
        )
        if self.trace is not None:
            self.trace.ended(self, reason, error)

    def _stop(self, *, failed: bool) -> None:
        """Release the engine request (aborted unless it finished), the timer and the session."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stream is not None:
            self._stream.close()
        self._release_session(failed)

    def _release_session(self, failed: bool) -> None:
        """Store the new sequence under the session key: deleted after EOS, unchanged after a
        failure, and the partial sequence after a cancel."""
        prep = self.prep
        if not prep.session_key:
            return
        seq = self.seqs[0]
        if seq.finished is FinishReason.EOS:
            tokens = None
        elif failed or not seq.token_ids:
            tokens = prep.session_previous
        else:
            tokens = prep.engine_request.prompt_ids + seq.token_ids
        self.p.sessions.release(prep.session_key, tokens)

    def _states_up_to(self, state: RequestState, now: float) -> list[ResponseDelta]:
        """Deltas for every state not yet sent, up to and including `state` (once each, in order)."""
        deltas = []
        target = _STATE_ORDER.index(state) + 1
        while self.sent_states < target:
            s = _STATE_ORDER[self.sent_states]
            self.sent_states += 1
            self.times.setdefault(s, now)
            if s is RequestState.SCHEDULED:
                self.p.tenants.scheduled(self.prep.engine_request.tenant)
            d = ResponseDelta(state=s)
            if s is RequestState.QUEUED:
                d.session_continued = self.prep.session_continued
                d.prompt_token_count = len(self.prep.engine_request.prompt_ids)
                if self.prep.echo:
                    d.prompt_text = self.p._decode_fn(self.prep)(self.prep.engine_request.prompt_ids)
            deltas.append(d)
        return deltas

    def _is_plain_step(self, out: EngineOutput) -> bool:
        """The gate of the step path, for a job started with `steps`: whether `out` is a plain
        decode step, one that neither enters a state nor ends the sequence and gives it one
        ordinary (not special) token, with its logprob when logprobs were asked for. Those go
        to the consumer as values (`_on_decode_step`); every other output takes `_on_output`."""
        if out.state is not None or out.finished or len(out.sequences) != 1 or self.sent_states != len(_STATE_ORDER):
            return False
        step = out.sequences[0]
        ids = step.token_ids
        return (
            step.finish_reason is None
            and len(ids) == 1
            and ids[0] not in self._special_ids
            and (not self.want_logprobs or (step.logprobs is not None and step.logprobs[0] is not None))
        )

    def _on_decode_step(self, out: EngineOutput, step: SequenceStep) -> None:
        """`_on_output` for a plain decode step (`_is_plain_step`), without building deltas:
        its text, token and logprob go to `Consumer.deliver_step`. A step whose text is still
        incomplete (a character split over tokens) sends nothing when the request asked for no
        tokens, as `_on_output` would."""
        self._metrics.step_outputs += 1
        seq = self.seqs[0]
        ids = step.token_ids
        if out.cached_tokens > self.cached_tokens:
            self.cached_tokens = out.cached_tokens
        logprob = None
        if step.logprobs is not None:
            logprob = step.logprobs[0]
            if logprob is not None:
                seq.cumulative_logprob += logprob
        seq.token_ids += ids
        seq.generated += 1
        now = out.time or time.monotonic()
        self._itl.observe(now - self.last_token_time)
        self.last_token_time = now
        text = seq.detok.push(ids)
        if text or self.want_tokens:
            self.consumer.deliver_step(self, text, ids[0], logprob if self.want_logprobs else None)

    def _on_output(self, out: EngineOutput) -> list[ResponseDelta]:
        now = out.time or time.monotonic()
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        deltas: list[ResponseDelta] = []
        if out.state is not None and out.state is not RequestState.GENERATING:
            deltas += self._states_up_to(out.state, now)
            if out.state is RequestState.PREFILLED and out.prompt_logprobs is not None:
                deltas[-1].prompt_tokens = self._prompt_tokens(out.prompt_logprobs)
        expired = self.prep.deadline is not None and now >= self.prep.deadline
        if not out.sequences and not out.finished and not expired:
            return deltas
        seq_deltas = []
        generated = False
        for step in out.sequences:
            seq = self.seqs[step.index]
            if seq.finished is None:
                generated = generated or bool(step.token_ids)
                seq_deltas.append(self._on_step(seq, step))
        if out.finished:  # e.g. a cancel without news for some sequences
            for seq in self.seqs:
                if seq.finished is None:
                    seq_deltas.append(self._finish(seq, FinishReason.CANCELLED, SequenceDelta(seq.index)))
        if expired:
            for seq in self.seqs:
                if seq.finished is None:
                    seq_deltas.append(self._finish(seq, FinishReason.TIME_LIMIT, SequenceDelta(seq.index)))
        if generated:
            deltas += self._states_up_to(RequestState.GENERATING, now)
            metrics = self.p.metrics
            if self.last_token_time:
                metrics.itl.observe(now - self.last_token_time)
            else:
                metrics.ttft.observe(now - self.prep.engine_request.arrival_time)
            self.last_token_time = now
        elif not seq_deltas:
            return deltas
        done = not self.unfinished
        if self.buffered:
            if not done:
                return deltas
            seq_deltas = self._best_of()
        body = deltas.pop() if deltas and deltas[-1].state is RequestState.GENERATING else ResponseDelta()
        body.sequences = [d for d in seq_deltas if d.text or d.tokens or d.finish_reason is not None]
        if done:
            body.final = self._final(now)
        if body.sequences or body.final is not None or body.state is not None:
            deltas.append(body)  # a step whose text is all held back (and no tokens asked) sends nothing
        return deltas

    def _on_step(self, seq: _Sequence, step: SequenceStep) -> SequenceDelta:
        prep = self.prep
        delta = SequenceDelta(seq.index)
        if step.logprobs is not None:
            seq.cumulative_logprob += sum(lp for lp in step.logprobs if lp is not None)
        if self.want_tokens:
            logprobs = self.want_logprobs
            for i, tok in enumerate(step.token_ids):
                lp = step.logprobs[i] if logprobs and step.logprobs is not None else None
                top = step.top_logprobs[i] if logprobs and step.top_logprobs is not None else None
                delta.tokens.append(self.p.token_info(tok, lp, top))
        seq.token_ids += step.token_ids
        seq.generated += len(step.token_ids)
        reason = step.finish_reason
        text_ids = step.token_ids
        ends_on_token = reason is FinishReason.EOS or step.stop_token_id is not None
        if ends_on_token and text_ids and not prep.include_stop:
            text_ids = text_ids[:-1]
        text = seq.detok.push(text_ids)
        if reason is not None:
            text += seq.detok.flush()
        if prep.stops and (seq.generated > prep.engine_request.min_new_tokens or reason is not None):
            match = seq.matcher.push(text)
            text = match.text
            if match.stop is not None:
                delta.text = text
                delta.stop_sequence = match.stop
                return self._finish(seq, FinishReason.STOP_SEQUENCE, delta)
        delta.text = text
        if reason is not None:
            delta.stop_token_id = step.stop_token_id
            return self._finish(seq, reason, delta)
        self._keep(seq, delta)
        return delta

    def _finish(self, seq: _Sequence, reason: FinishReason, delta: SequenceDelta) -> SequenceDelta:
        if reason is not FinishReason.STOP_SEQUENCE or delta.stop_token_id is not None:
            delta.text += seq.matcher.flush()
        seq.finished = reason
        self.unfinished -= 1
        delta.finish_reason = reason
        seq.stop_sequence, seq.stop_token_id = delta.stop_sequence, delta.stop_token_id
        if self.want_logprobs:
            delta.cumulative_logprob = seq.cumulative_logprob
        self._keep(seq, delta)
        return delta

    def _keep(self, seq: _Sequence, delta: SequenceDelta) -> None:
        if self.buffered:
            seq.text_parts.append(delta.text)
            seq.tokens += delta.tokens

    def _best_of(self) -> list[SequenceDelta]:
        """Pick the n sequences with the highest cumulative logprob; re-index them 0..n-1."""
        ranked = sorted(self.seqs, key=lambda s: (-s.cumulative_logprob, s.index))[: self.prep.n]
        out = []
        for new_index, seq in enumerate(ranked):
            out.append(
                SequenceDelta(
                    index=new_index,
                    text="".join(seq.text_parts),
                    tokens=seq.tokens,
                    finish_reason=seq.finished,
                    stop_sequence=seq.stop_sequence,
                    stop_token_id=seq.stop_token_id,
                    cumulative_logprob=seq.cumulative_logprob if self.prep.request.output.logprobs else None,
                )
            )
        self.returned = ranked
        return out

    def _final(self, now: float) -> FinalInfo:
        req = self.prep.engine_request
        returned = self.returned
        scheduled = self.times.get(RequestState.SCHEDULED, now)  # never scheduled: queued all along
        prefilled = self.times.get(RequestState.PREFILLED, scheduled)
        timing = Timing(
            queue_ms=(scheduled - req.arrival_time) * 1000.0,
            prefill_ms=(prefilled - scheduled) * 1000.0,
            total_ms=(time.monotonic() - req.arrival_time) * 1000.0,
        )
        usage = Usage(len(req.prompt_ids), sum(s.generated for s in returned), self.cached_tokens)
        sampling = self.prep.sampling
        seed = sampling.seed if sampling.do_sample is False or self.p.engine.info.reproducible_seeds else None
        return FinalInfo(usage=usage, seed=seed, effective=sampling, timing=timing)

    def _prompt_tokens(self, infos: list[PromptTokenInfo]) -> list[TokenInfo]:
        return [self.p.token_info(i.token_id, i.logprob, i.top) for i in infos]


def merge_deltas(deltas: Sequence[ResponseDelta]) -> list[ResponseDelta]:
    """Coalesce the deltas that waited for a slow consumer into as few as keep their meaning.

    A delta that enters no lifecycle state (and so carries no prompt text or tokens either) is
    merged into the one before it when that one is a plain delta or the GENERATING one and is
    not final: per sequence, text is concatenated and tokens appended, and the finish fields
    and cumulative logprob are the later ones; `final` moves along. Lifecycle deltas keep their
    own messages, in order. Nothing is dropped or reordered. A delta merged into is modified.
    """
    out: list[ResponseDelta] = []
    for d in deltas:
        prev = out[-1] if out else None
        if (
            prev is None
            or d.state is not None
            or prev.final is not None
            or (prev.state is not None and prev.state is not RequestState.GENERATING)
        ):
            out.append(d)
            continue
        by_index = {s.index: s for s in prev.sequences}
        for s in d.sequences:
            mine = by_index.get(s.index)
            if mine is None:
                mine = by_index[s.index] = SequenceDelta(s.index)
                prev.sequences.append(mine)
            mine.text += s.text
            mine.tokens += s.tokens
            if s.finish_reason is not None:
                mine.finish_reason = s.finish_reason
                mine.stop_sequence = s.stop_sequence
                mine.stop_token_id = s.stop_token_id
            if s.cumulative_logprob is not None:
                mine.cumulative_logprob = s.cumulative_logprob
        prev.final = d.final
    return out
