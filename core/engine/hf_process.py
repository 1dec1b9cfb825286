"""The HF engine in a process of its own: the default of `--engine hf` (`--no-engine-process`
keeps it on a thread of the core process).

Why: a model step of core.engine.hf is Python between torch kernels, and each kernel hands the
GIL back. On a thread of the core, every step then waits for the request pipeline and gRPC
(which hold the GIL up to the switch interval each time), so the step takes longer the more
tokens the core streams. In a process of its own the step never waits on serving work, and the
serving side runs on another core meanwhile (vLLM's engine core and SGLang's scheduler run in
their own processes for the same reason).

Shape: `HfProcessEngine` implements core.engine.base.Engine in the core process; the child
process runs core.engine.hf.HfEngine's batching loop unchanged in its main thread. Messages
are pickled over two one-way pipes (multiprocessing's spawn context: a forked child would copy
the core's gRPC threads, which fork cannot do safely), each one of the typed messages below, so
that mypy checks what each side sends and that each receiver handles every kind (`match`
ending in `assert_never`):

  core -> engine   ToEngine: Generate(request), Abort(request_id), Stop(),
                   LoadAdapter(call, spec), UnloadAdapter(call, name)
  engine -> core   Loaded, exactly once and first: Ready() or Failed(reason);
                   then Running: Outputs, one per engine step, every request's outputs of that
                   step in order as `Packed` tuples (`pack`: plain tuples pickle about 10x
                   faster than the dataclasses), a bare list as it is the hot path;
                   PrefixCache(stats) after a step that changed the prefix cache's counters;
                   Resident(names) after a step that changed the adapters in slots;
                   AdapterDone(call, error) answering each LoadAdapter and UnloadAdapter;
                   Dead(reason) when the batching loop failed

Every engine output crosses packed, the refusal of a request the engine process cannot admit
included: the core unpacks each one.

Admission (queue bound, duplicate ids, batch limits) is decided in the core process, so
`generate` raises synchronously as the Engine contract requires. Only the engine process
compiles guides: a guide that does not compile there (the request pipeline refuses those
before, core.guided.check_compiles), like a request that arrives as it stops, ends its stream
with the error instead (an Outputs list of one packed output). The proxy counts a request as
queued until its SCHEDULED output arrives, which is never fewer than the engine's own queue.
The engine process exits when told to stop, when its batching loop dies, or when the core
process goes away (its end of the pipe closes).

Watchdog: the core never blocks on the pipe to the engine process (a sender thread writes it),
turns health NOT_SERVING when the engine has not stepped for --engine-stall-seconds with
requests pending, and starts a new engine process when one dies (--engine-max-restarts within
RESTART_WINDOW_S), its requests having ended with EngineDead; see HfProcessEngine.

CPUs (`--engine-cpus`, core.engine.hf_config.engine_cpus): by default, where the machine has
more CPUs than the engine has torch threads, the engine process runs on CPUs of its own and the
core process's threads (and the engine process's receiver thread) on the others, so serving
work never preempts a model step; the core's threads get their CPUs back at shutdown.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, assert_never

import servegc
from core.engine.base import EngineLifecycle, OutputStream
from core.engine.hf_config import (
    KIND,
    check_request,
    default_threads,
    duplicate_id,
    engine_cpus,
    engine_info,
    queue_full,
)
from core.errors import CoreError, EngineDead, NotReady
from core.lora import AdapterSpec, AdapterStatus, adapter_exists, unknown_adapter
from core.sampling import resolve_generic
from core.types import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    PrefixCacheStats,
    PromptTokenInfo,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

if TYPE_CHECKING:
    from core.config import CoreConfig
    from core.engine.base import Engine
    from core.engine.hf import HfEngine
    from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Seconds shutdown waits for the engine process to exit before killing it.
EXIT_TIMEOUT_S = 30.0


def build(config: CoreConfig, tokenizer: Tokenizer) -> Engine:
    """Engine factory for `--engine hf` (see core.engine.registry): the engine in its own
    process, or on a thread of this one with `--no-engine-process`."""
    from core.engine import hf

    if not config.engine_process:
        return hf.build(config, tokenizer)
    return HfProcessEngine(
        config.model,
        hf.engine_kwargs(config, tokenizer),
        cpus=config.engine_cpus,
        stall_seconds=config.engine_stall_seconds,
        max_restarts=config.engine_max_restarts,
    )


# -------------------------------------------------------------------- wire format

#: One sequence's news as plain values: (index, token_ids, logprobs, top_logprobs, finish
#: reason value, stop_token_id) (core.types.SequenceStep).
PackedSequence: TypeAlias = tuple[
    int, list[int], list[float | None] | None, list[list[tuple[int, float]]] | None, str | None, int | None
]
#: A prompt token as plain values: (token_id, logprob, top) (core.types.PromptTokenInfo).
PackedPromptToken: TypeAlias = tuple[int, float | None, list[tuple[int, float]]]
#: An EngineOutput as plain values: (request_id, state value, sequences, prompt_logprobs,
#: finished, cached_tokens, error, time).
Packed: TypeAlias = tuple[
    str, int | None, list[PackedSequence], list[PackedPromptToken] | None, bool, int, Exception | None, float
]


def pack(out: EngineOutput) -> Packed:
    """An EngineOutput as plain tuples (see Packed); `unpack` inverts it."""
    return (
        out.request_id,
        None if out.state is None else out.state.value,
        [
            (
                s.index,
                s.token_ids,
                s.logprobs,
                s.top_logprobs,
                None if s.finish_reason is None else s.finish_reason.value,
                s.stop_token_id,
            )
            for s in out.sequences
        ],
        None if out.prompt_logprobs is None else [(p.token_id, p.logprob, p.top) for p in out.prompt_logprobs],
        out.finished,
        out.cached_tokens,
        out.error,
        out.time,
    )


def unpack(packed: Packed) -> EngineOutput:
    """The EngineOutput `pack` flattened."""
    rid, state, seqs, prompt, finished, cached, error, at = packed
    return EngineOutput(
        rid,
        None if state is None else RequestState(state),
        [
            SequenceStep(i, ids, lps, tops, None if reason is None else FinishReason(reason), stop)
            for i, ids, lps, tops, reason, stop in seqs
        ],
        None if prompt is None else [PromptTokenInfo(*p) for p in prompt],
        finished,
        cached,
        error,
        at,
    )


# -------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Generate:
    """core -> engine: run `request` (the core process admitted it already)."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort:
    """core -> engine: cancel a request at the engine's next step boundary (no-op when unknown
    or finished)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """core -> engine: end the requests left with NotReady and exit."""


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """core -> engine: register a LoRA adapter (HfEngine.add_adapter); answered by AdapterDone
    with the same `call`."""

    call: int
    spec: AdapterSpec


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    """core -> engine: unregister a LoRA adapter (HfEngine.remove_adapter); answered by
    AdapterDone with the same `call`."""

    call: int
    name: str


#: What the core sends the engine process.
ToEngine: TypeAlias = Generate | Abort | Stop | LoadAdapter | UnloadAdapter


@dataclass(frozen=True, slots=True)
class Ready:
    """engine -> core, first: the model is loaded; requests are welcome."""


@dataclass(frozen=True, slots=True)
class Failed:
    """engine -> core, first and last: loading the model failed (`reason`: the exception's type
    and message); the process exits."""

    reason: str


#: engine -> core: one engine step's outputs, every request's in order (packed). The one
#: message without a dataclass of its own, as it is the one sent every engine step: a frozen
#: dataclass around the list costs about 7 µs more per message to pickle and unpickle, +11 % of
#: a 32-output step's whole cost (pack, pickle, unpickle, unpack; scripts/bench/engine_messages.py),
#: and no other message is a list, so `case list()` tells it apart all the same.
Outputs: TypeAlias = list[Packed]


@dataclass(frozen=True, slots=True)
class Dead:
    """engine -> core, last: the batching loop failed (`reason`: the error); the process exits
    and every request left ends with EngineDead."""

    reason: str


@dataclass(frozen=True, slots=True)
class PrefixCache:
    """engine -> core: the prefix cache's counters, after a step that changed them (the core's
    EngineStats reads them)."""

    stats: PrefixCacheStats


@dataclass(frozen=True, slots=True)
class AdapterDone:
    """engine -> core: LoadAdapter or UnloadAdapter `call` done (`error`: why it was refused)."""

    call: int
    error: CoreError | None


@dataclass(frozen=True, slots=True)
class Resident:
    """engine -> core: the adapters in slots, after a step that changed them."""

    names: frozenset[str]


#: The engine process's first message: whether it loaded the model.
Loaded: TypeAlias = Ready | Failed
#: Its messages after Ready.
Running: TypeAlias = Outputs | PrefixCache | Resident | AdapterDone | Dead
#: What the engine process sends the core.
FromEngine: TypeAlias = Loaded | Running


@dataclass(eq=False, slots=True)
class _Live:
    """A request the engine process has not finished yet."""

    stream: OutputStream
    scheduled: bool = False
    aborted: bool = False
    adapter: str = ""


@dataclass(eq=False, slots=True)
class _Link:
    """One engine process and the threads that carry its messages: `inbox` (read by the
    `reader` thread), `outbox` (written by the `sender` thread from `outgoing`)."""

    process: Any  # multiprocessing's SpawnProcess (untyped in typeshed)
    inbox: Connection
    outbox: Connection
    outgoing: queue.SimpleQueue[ToEngine | None]
    reader: threading.Thread | None = None
    sender: threading.Thread | None = None


#: Seconds over which --engine-max-restarts counts the engine process's restarts.
RESTART_WINDOW_S = 600.0


class HfProcessEngine(EngineLifecycle):
    """The Engine protocol in the core process over core.engine.hf.HfEngine in a child process.

    Args:
        model_path: Hugging Face checkpoint directory.
        engine_kwargs: HfEngine's keyword arguments (core.engine.hf.engine_kwargs); the limits
            among them are enforced here as HfEngine enforces them.
        cpus: `--engine-cpus` ("auto", "none" or a CPU list; core.engine.hf_config.engine_cpus).
        stall_seconds: `--engine-stall-seconds`: seconds without a message from the engine
            process while requests are pending after which health reports NOT_SERVING, until
            the next message (0: no watchdog).
        max_restarts: `--engine-max-restarts`: restarts of a process that died allowed within
            RESTART_WINDOW_S; beyond, the engine is dead (EngineDead, health NOT_SERVING).

    All state is touched on the event loop only. The event loop never blocks on the engine
    process: a reader thread turns its messages into event-loop callbacks, and a sender thread
    writes what the loop hands it (`_send` puts on a queue). That queue is bounded by admission:
    a Generate per admitted request (at most max_queue_size waiting, since a stalled engine
    schedules none) and at most one Abort each.

    Watchdog and restart: an engine process that stops stepping with requests pending (stopped,
    deadlocked, swapping) turns health NOT_SERVING (`set_on_health`) after `stall_seconds`, and
    SERVING again once it steps. One that dies (killed, out of memory) ends its running
    requests with EngineDead in their streams, and those it had not scheduled yet with NotReady
    (they lost nothing), and is started again; meanwhile health is NOT_SERVING and new requests
    get NotReady (UNAVAILABLE: gateways answer 503 with Retry-After).
    """

    kind = KIND

    def __init__(
        self,
        model_path: str | Path,
        engine_kwargs: dict[str, Any],
        cpus: str = "none",
        *,
        stall_seconds: float = 30.0,
        max_restarts: int = 3,
    ):
        super().__init__()
        self._path = str(model_path)
        self._kwargs = engine_kwargs
        self._cpus = cpus
        self._stall_s = stall_seconds
        self._max_restarts = max_restarts
        self._unpin: Callable[[], None] | None = None  # gives the core's threads their CPUs back
        self._max_batch = int(engine_kwargs["max_batch_size"])
        self._max_queue = int(engine_kwargs["max_queue_size"])
        self._max_total = int(engine_kwargs["max_total_tokens"])
        self.info = engine_info(
            self._path,
            vocab_size=int(engine_kwargs["vocab_size"]),
            max_n=int(engine_kwargs["max_n"]),
            max_batch_size=self._max_batch,
            guided_decoding=guides.kinds if (guides := engine_kwargs.get("guides")) is not None else frozenset(),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spawn_args: tuple[dict[str, Any], tuple[frozenset[int], frozenset[int]] | None] = (engine_kwargs, None)
        self._link: _Link | None = None
        self._live: dict[str, _Live] = {}
        self._queued = 0
        self._prefix = PrefixCacheStats() if engine_kwargs.get("prefix_cache_bytes") else None
        self._death: str | None = None  # the engine process's own account of its death
        self._progress = 0.0  # monotonic time of its latest message, or of work reaching an idle engine
        self._stalled = False
        self._restarting = False
        self._restarted_at: deque[float] = deque()
        self._restarts = 0
        self._tasks: set[asyncio.Task[None]] = set()  # the watchdog and a restart under way

        # LoRA adapters: those registered, those in the engine's slots (as of its latest step),
        # and the LoadAdapter / UnloadAdapter calls awaiting their AdapterDone.
        self.max_loras = int(engine_kwargs.get("max_loras", 0))
        self._adapters: dict[str, AdapterSpec] = {}
        self._resident: frozenset[str] = frozenset()
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._call_ids = itertools.count(1)

    @property
    def _process(self) -> Any:
        """The current engine process (None before start)."""
        return None if self._link is None else self._link.process

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded.

        Raises:
            RuntimeError: the engine process failed to load the model or exited (the message
                says why; the process is gone by then).
            ValueError: `cpus` names a CPU this process may not run on.
        """
        self._loop = asyncio.get_running_loop()
        # Resolved here, before any pinning narrows what this process (and the child) may use.
        threads = default_threads(int(self._kwargs["threads"]))
        placement = engine_cpus(self._cpus, threads)
        self._spawn_args = ({**self._kwargs, "threads": threads}, placement)
        await self._spawn()
        self._started = self._alive = True
        if placement is not None:
            self._unpin = pin_threads(placement[1])
            log.info(
                "hf engine: serving from process %d on CPUs %s (serving threads on CPUs %s)",
                self._process.pid,
                _cpu_names(placement[0]),
                _cpu_names(placement[1]),
            )
        else:
            log.info("hf engine: serving from process %d", self._process.pid)
        if self._stall_s > 0:
            self._spawn_task(self._watch())

    async def _spawn(self) -> None:
        """Start an engine process, wait for its model, and start its reader and sender threads.

        Raises:
            RuntimeError: it failed to load the model or exited (it is gone by then).
        """
        kwargs, placement = self._spawn_args
        ctx = multiprocessing.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel()
        process = ctx.Process(
            target=_engine_main,
            args=(self._path, kwargs, level, to_engine_r, from_engine_w, placement),
            name="trellis-hf-engine",
            daemon=True,
        )
        process.start()
        to_engine_r.close()
        from_engine_w.close()
        link = _Link(process, from_engine_r, to_engine_w, queue.SimpleQueue())
        try:
            loaded: Loaded = await asyncio.to_thread(link.inbox.recv)
        except (EOFError, OSError):
            await asyncio.to_thread(process.join, EXIT_TIMEOUT_S)
            _close(link)
            raise RuntimeError(
                f"the hf engine process exited while loading {self._path} (exit code {process.exitcode})"
            ) from None
        match loaded:
            case Ready():
                pass
            case Failed(reason):
                await asyncio.to_thread(process.join, EXIT_TIMEOUT_S)
                _close(link)
                raise RuntimeError(f"the hf engine process could not load {self._path}: {reason}")
            case _:
                assert_never(loaded)
        self._link, self._death, self._progress = link, None, time.monotonic()
        link.reader = threading.Thread(target=self._read, args=(link,), name="hf-engine-reader", daemon=True)
        link.sender = threading.Thread(target=_write, args=(link,), name="hf-engine-sender", daemon=True)
        link.reader.start()
        link.sender.start()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        """Stop the engine process; requests still queued or running end with NotReady."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        link = self._link
        if link is not None:
            process = link.process
            if process.is_alive():
                self._send(Stop())
                await asyncio.to_thread(process.join, EXIT_TIMEOUT_S)
                if process.is_alive():
                    log.error("hf engine process %d did not stop in %.0f s; killing it", process.pid, EXIT_TIMEOUT_S)
                    process.kill()
                    await asyncio.to_thread(process.join)
            link.outgoing.put(None)
            for thread in (link.reader, link.sender):
                if thread is not None:
                    await asyncio.to_thread(thread.join)
            await asyncio.sleep(0)  # the reader's last callbacks run before anything is failed here
        self._fail_live(NotReady("The engine shut down; retry on another replica."))
        self._alive = False
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        if link is not None:
            _close(link)

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """The generic (LMI "every rolling batch backend") defaults, as HfEngine."""
        return resolve_generic(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests the engine process runs, and those not scheduled yet; the prefix cache's
        counters as of the engine's latest step; restarts, and how long it has not stepped
        with requests pending."""
        return EngineStats(
            active=len(self._live) - self._queued,
            queued=self._queued,
            prefix_cache=self._prefix,
            restarts=self._restarts,
            stall_seconds=self._stall_for(time.monotonic()),
        )

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        """Whether the adapter `name` is registered."""
        return name in self._adapters

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter: residency as of the engine's latest step, and this side's
        count of its requests running (scheduled) and waiting."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for live in self._live.values():
            if live.adapter:
                counts = running if live.scheduled else waiting
                counts[live.adapter] = counts.get(live.adapter, 0) + 1
        return [
            AdapterStatus(spec, name in self._resident, running.get(name, 0), waiting.get(name, 0))
            for name, spec in sorted(self._adapters.items())
        ]

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register an adapter in the engine process (HfEngine.add_adapter, which raises what
        this raises)."""
        if spec.name in self._adapters:
            raise adapter_exists(spec.name)
        call = next(self._call_ids)
        await self._call(call, LoadAdapter(call, spec))
        self._adapters[spec.name] = spec

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter (HfEngine.remove_adapter).

        Raises:
            AdapterNotFound: `name` is not registered.
        """
        if name not in self._adapters:
            raise unknown_adapter(name)
        call = next(self._call_ids)
        await self._call(call, UnloadAdapter(call, name))
        self._adapters.pop(name, None)

    async def _call(self, call: int, message: ToEngine, *, check: bool = True) -> None:
        """Send an adapter call and wait for its AdapterDone (raising its error); `check`: only
        while serving (a restart re-registers before it serves)."""
        if check:
            self._check_serving()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        if not self._send(message):
            self._calls.pop(call, None)
            raise EngineDead(f"The {self.kind} engine has stopped.")
        await future

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Admit a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady: the engine is not serving yet or any more, or its process is restarting.
            EngineDead: the engine process died and may not be restarted again.
            InvalidArgument: more sequences or batch tokens than the batch can ever hold, or the
                id of a request still running.
            Overloaded: max_queue_size requests are already waiting.
        """
        check_request(request, self._max_batch, self._max_total)
        self._check_serving()
        if request.adapter and request.adapter not in self._adapters:
            raise unknown_adapter(request.adapter)
        rid = request.request_id
        if rid in self._live:
            raise duplicate_id(rid)
        if self._queued >= self._max_queue:
            raise queue_full(self._max_queue)

        def on_close(finished: bool) -> None:
            if not finished:
                self.abort(rid)

        first = EngineOutput(rid, state=RequestState.QUEUED, time=time.monotonic())
        live = _Live(OutputStream(first, on_close), adapter=request.adapter)
        if not self._send(Generate(request)):
            raise EngineDead(f"The {self.kind} engine has stopped and cannot take requests.")
        if not self._live:  # an idle engine's silence was no stall: the watchdog counts from now
            self._progress = time.monotonic()
        self._live[rid] = live
        self._queued += 1
        return live.stream

    def _check_serving(self) -> None:
        super()._check_serving()
        if self._restarting:
            raise NotReady(f"The {self.kind} engine is restarting after its process exited; retry shortly.")

    def abort(self, request_id: str) -> None:
        """Cancel a request at the engine's next step boundary (no-op when unknown or finished)."""
        live = self._live.get(request_id)
        if live is not None and not live.aborted:
            live.aborted = True
            self._send(Abort(request_id))

    def _send(self, message: ToEngine) -> bool:
        """Hand a message to the sender thread, never blocking; False when there is no engine
        process (a broken pipe is handled when the reader sees it close)."""
        if self._link is None:
            return False
        self._link.outgoing.put(message)
        return True

    # ---------------------------------------------------------------- messages from the engine

    def _read(self, link: _Link) -> None:
        """Reader thread: each message from the engine process becomes one event-loop callback."""
        while True:
            try:
                message: Running = link.inbox.recv()
            except (EOFError, OSError):
                break
            if not self._post(self._on_message, message):
                return
        # The pipe closes a moment before the process is reaped: wait for its exit code (bounded,
        # a process that closed its pipe but lingers is reported without one).
        link.process.join(EXIT_TIMEOUT_S)
        link.outgoing.put(None)  # the sender stops too
        self._post(self._on_exit, link)

    def _post(self, callback: Callable[..., None], *args: Any) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            return False
        return True

    def _on_message(self, message: Running) -> None:
        self._progress = time.monotonic()
        if self._stalled:
            self._stalled = False
            log.warning("hf engine process %d steps again", self._process.pid)
            self._set_health(True)
        match message:
            case list():
                self._deliver([unpack(out) for out in message])
            case PrefixCache(stats):
                self._prefix = stats
            case Resident(names):
                self._resident = names
            case AdapterDone(call, error):
                future = self._calls.pop(call, None)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)
            case Dead(reason):
                self._death = reason
            case _:
                assert_never(message)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """One engine step's outputs to their streams; a request's final output retires it."""
        live_map = self._live
        for out in outputs:
            live = live_map.get(out.request_id)
            if live is None:
                continue
            if not live.scheduled and (out.state is RequestState.SCHEDULED or out.sequences):
                live.scheduled = True
                self._queued -= 1
            live.stream.put(out)
            if out.finished or out.error is not None:
                del live_map[out.request_id]
                if not live.scheduled:
                    self._queued -= 1

    def _on_exit(self, link: _Link) -> None:
        """The engine process closed its pipe: it exited (as told to, or not). It is restarted
        unless shutting down or out of restarts; its running requests end with EngineDead, and
        those not scheduled yet with NotReady when it is restarted."""
        if link is not self._link or (self._stopping and self._death is None):
            return  # shutdown fails what is left
        code = link.process.exitcode
        reason = self._death or f"the engine process exited unexpectedly (exit code {code})"
        now = time.monotonic()
        while self._restarted_at and now - self._restarted_at[0] > RESTART_WINDOW_S:
            self._restarted_at.popleft()
        if self._stopping or len(self._restarted_at) >= self._max_restarts:
            self._fail_live(EngineDead(f"The engine stopped: {reason}"))
            self._mark_dead(EngineDead(reason))
            return
        # Requests not scheduled yet lost nothing: UNAVAILABLE tells their clients to retry.
        retry = NotReady(f"The {self.kind} engine is restarting after its process exited; retry shortly.")
        self._fail_live(EngineDead(f"The engine stopped: {reason}"), unscheduled=retry)
        self._restarted_at.append(now)
        self._restarting, self._stalled = True, False
        log.error("hf engine process %d: %s; restarting it", link.process.pid, reason)
        self._set_health(False)
        self._spawn_task(self._restart(link))

    async def _restart(self, dead: _Link) -> None:
        """Start a new engine process in place of `dead`; the engine is dead if it cannot."""
        await asyncio.to_thread(_join_threads, dead)
        _close(dead)
        try:
            await self._spawn()
        except Exception as e:  # the model no longer loads: nothing to serve with
            self._restarting = False
            self._mark_dead(EngineDead(f"the engine process could not be restarted: {e}"))
            return
        for spec in list(self._adapters.values()):  # the new process knows none of them
            call = next(self._call_ids)
            try:
                await self._call(call, LoadAdapter(call, spec), check=False)
            except Exception as e:  # registered before, so only a changed file fails
                log.error("hf engine: adapter %s could not be loaded again after the restart: %s", spec.name, e)
                self._adapters.pop(spec.name, None)
        self._restarting = False
        self._restarts += 1
        log.warning("hf engine: serving again from process %d", self._process.pid)
        self._set_health(True)

    # ---------------------------------------------------------------- watchdog

    def _stall_for(self, now: float) -> float:
        """Seconds the engine process has sent nothing while requests are pending (0: none)."""
        if not self._live or self._restarting or self._link is None:
            return 0.0
        return max(0.0, now - self._progress)

    async def _watch(self) -> None:
        """The stall watchdog: health NOT_SERVING once the engine has not stepped for
        stall_seconds with requests pending (`_on_message` turns it back)."""
        period = max(0.05, self._stall_s / 4)
        while True:
            await asyncio.sleep(period)
            stalled_for = self._stall_for(time.monotonic())
            if stalled_for > self._stall_s and not self._stalled:
                self._stalled = True
                log.error(
                    "hf engine process %d has not stepped for %.1f s with %d requests pending; health is NOT_SERVING",
                    self._process.pid,
                    stalled_for,
                    len(self._live),
                )
                self._set_health(False)

    def _fail_live(self, error: Exception, unscheduled: Exception | None = None) -> None:
        """End every live request with `error` (those never scheduled with `unscheduled`, if given)."""
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        now = time.monotonic()
        live, self._live, self._queued = self._live, {}, 0
        for rid, entry in live.items():
            failed = error if entry.scheduled or unscheduled is None else unscheduled
            entry.stream.put(EngineOutput(rid, error=failed, finished=True, time=now))


def _write(link: _Link) -> None:
    """Sender thread: write what the event loop queued to the engine process, in order, until
    None, a Stop, or a broken pipe (the reader sees the process exit)."""
    while (message := link.outgoing.get()) is not None:
        try:
            link.outbox.send(message)
        except (OSError, ValueError):  # broken pipe, or closed
            return
        if isinstance(message, Stop):
            return


def _join_threads(link: _Link) -> None:
    link.outgoing.put(None)
    for thread in (link.reader, link.sender):
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _close(link: _Link) -> None:
    for conn in (link.inbox, link.outbox):
        conn.close()


# -------------------------------------------------------------------- CPUs


def pin_threads(cpus: frozenset[int]) -> Callable[[], None]:
    """Restrict every thread of this process to `cpus` (threads started later inherit it from
    the thread that starts them); returns a function that gives every thread of the process the
    CPUs the calling thread had before (Linux: the affinity is per thread)."""
    before = os.sched_getaffinity(0)
    _set_all_threads(cpus)
    return lambda: _set_all_threads(before)


def _set_all_threads(cpus: set[int] | frozenset[int]) -> None:
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), cpus)
        except OSError:  # a thread that exited meanwhile
            continue


def _cpu_names(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


# -------------------------------------------------------------------- the engine process


def _engine_main(
    model_path: str,
    engine_kwargs: dict[str, Any],
    log_level: int,
    inbox: Connection,
    outbox: Connection,
    placement: tuple[frozenset[int], frozenset[int]] | None = None,
) -> None:
    """Entry point of the engine process: load, say "ready", then run the batching loop in this
    thread while a receiver thread admits requests; returns (and the process exits) when the
    loop stops. With a placement (engine CPUs, serving CPUs), the process runs on the engine
    CPUs (torch's threads start after this and inherit them) and the receiver on the serving
    CPUs, so that unpickling requests never takes the engine's CPU from a model step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the core decides
    if placement is not None:
        pin_threads(placement[0])
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from core.engine.hf import Emits, HfEngine

    send_lock = threading.Lock()
    sent: list[PrefixCacheStats | None] = [None]  # the prefix cache counters the core has
    resident: list[frozenset[str]] = [frozenset()]  # the adapters in slots the core knows of

    def send(message: FromEngine) -> None:
        with send_lock:  # the batching loop and the receiver both send
            try:
                outbox.send(message)
            except OSError:  # the core is gone; the receiver sees its pipe close and stops us
                pass

    class ChildEngine(HfEngine):
        """HfEngine whose step outputs and death go to the core process."""

        def _publish(self, emits: Emits) -> None:
            send([pack(out) for _, out in emits])
            stats = self.prefix_stats()
            if stats is not None and stats != sent[0]:
                sent[0] = stats
                send(PrefixCache(stats))
            if self._bank is not None and (names := self._bank.resident()) != resident[0]:
                resident[0] = names
                send(Resident(names))

        def _report_death(self, error: Exception) -> None:
            send(Dead(str(error)))

    try:
        engine = ChildEngine(model_path, **engine_kwargs)
        engine.load()
    except Exception as e:
        log.exception("hf engine process: loading %s failed", model_path)
        send(Failed(f"{type(e).__name__}: {e}"))
        return
    receiver = threading.Thread(target=_receive, args=(engine, inbox, send), name="hf-engine-inbox", daemon=True)
    receiver.start()
    if placement is not None and receiver.native_id is not None:
        os.sched_setaffinity(receiver.native_id, placement[1])
    servegc.settle()
    send(Ready())  # the core sends nothing before this
    engine.run()


def _receive(engine: HfEngine, inbox: Connection, send: Callable[[FromEngine], None]) -> None:
    """The engine process's receiver thread: requests, aborts and the stop order from the core
    (a closed pipe means the core is gone: stop too)."""
    while True:
        try:
            message: ToEngine = inbox.recv()
        except (EOFError, OSError):
            message = Stop()
        match message:
            case Generate(request):
                try:
                    engine.submit(request)
                except CoreError as e:  # a guide that does not compile, or a stop or death meanwhile
                    refusal = EngineOutput(request.request_id, error=e, finished=True, time=time.monotonic())
                    send([pack(refusal)])
            case Abort(request_id):
                engine.abort(request_id)
            case LoadAdapter(call, spec):
                send(AdapterDone(call, _adapter_call(engine.add_adapter, spec)))
            case UnloadAdapter(call, name):
                send(AdapterDone(call, _adapter_call(engine.remove_adapter, name)))
            case Stop():
                engine.stop_soon()
                return
            case _:
                assert_never(message)


def _adapter_call(method: Callable[[Any], None], arg: Any) -> CoreError | None:
    """Run an HfEngine adapter method; its refusal, or None."""
    try:
        method(arg)
    except CoreError as e:
        return e
    return None
