"""The token-level engine protocol every engine implements, and the pieces the engines share.

Engines batch requests in flight and stream token ids with logprobs; everything textual
(templates, detokenization, stop strings, sessions) lives in the request pipeline. Engines see
only `core.types` dataclasses, never protobuf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from core.errors import EngineDead, NotReady
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PromptTokenInfo,
    ResolvedSampling,
    SamplingOptions,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Engine(Protocol):
    """An in-flight batching engine.

    Contract of `generate`:
      * raises, when called, `core.errors.Overloaded` when its queue is full, `NotReady` while
        starting or shutting down, `EngineDead` once it can serve no more, and
        `InvalidArgument` for a request it cannot run;
      * otherwise returns an OutputStream whose first output has state QUEUED, then SCHEDULED
        and PREFILLED when known (an engine that cannot observe them may skip them; the
        pipeline fills them in), then token outputs; the last output has `finished=True` or
        carries `error`;
      * when the consumer stops early (closes the stream, or is cancelled while waiting), the
        request is aborted within one engine step and its resources are freed.
    """

    info: EngineInfo

    async def start(self) -> None:
        """Load the model and start the batching loop."""

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """Apply this engine's defaults to unset fields (a pure function of the arguments)."""

    def generate(self, request: EngineRequest) -> OutputStream:
        """Admit one request and stream its outputs; see the class docstring for the contract."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when unknown or finished); takes effect within one step."""

    def stats(self) -> EngineStats:
        """Requests running and waiting right now."""

    @property
    def alive(self) -> bool:
        """False once the engine can serve no more requests."""

    def set_on_dead(self, callback: Callable[[Exception], None]) -> None:
        """Register the callback invoked (on the event loop) when the engine dies."""

    def set_on_health(self, callback: Callable[[bool], None]) -> None:
        """Register the callback invoked (on the event loop) when the engine stops serving for a
        while (False: it stalled, or its process is restarting) and when it serves again (True)."""

    async def shutdown(self) -> None:
        """Stop the loop and free the model; requests still running end with a NotReady error
        (or CANCELLED, where the runtime ends them itself), and new ones are refused."""


class EngineLifecycle:
    """Liveness bookkeeping shared by the engines: `alive`, `set_on_dead`, `set_on_health`, the
    admission check and the one-time death notice.

    Engines set `_started` and `_alive` once started and `_stopping` when shutdown begins, and
    call `_mark_dead` (on the event loop) when they can serve no more.
    """

    kind = "engine"

    def __init__(self) -> None:
        self._alive = False
        self._started = False
        self._stopping = False
        self._died = False
        self._on_dead: Callable[[Exception], None] | None = None
        self._on_health: Callable[[bool], None] | None = None

    @property
    def alive(self) -> bool:
        """False before start, once the engine died, and after shutdown."""
        return self._alive

    def set_on_dead(self, callback: Callable[[Exception], None]) -> None:
        """Register the callback invoked (on the event loop) when the engine dies."""
        self._on_dead = callback

    def set_on_health(self, callback: Callable[[bool], None]) -> None:
        """Register the callback invoked (on the event loop) when the engine stops serving for a
        while (False) and when it serves again (True)."""
        self._on_health = callback

    def _set_health(self, serving: bool) -> None:
        """Tell the health callback the engine serves (True) or not for now (False). Call on the
        event loop."""
        if self._on_health is not None:
            self._on_health(serving)

    def _check_serving(self) -> None:
        """Raise unless requests can be admitted now.

        Raises:
            NotReady: not started yet, or shutting down (UNAVAILABLE: another replica may serve).
            EngineDead: the engine died (INTERNAL; health is NOT_SERVING by then).
        """
        if self._stopping or not self._started:
            raise NotReady(f"The {self.kind} engine is not serving (starting or shutting down); retry shortly.")
        if not self._alive:
            raise EngineDead(f"The {self.kind} engine has stopped and cannot take requests.")

    def _mark_dead(self, error: Exception) -> bool:
        """Stop admitting requests and, the first time, log the cause and run the on-dead
        callback. Call on the event loop. Returns whether this was the first time."""
        self._alive = False
        if self._died:
            return False
        self._died = True
        log.error("%s engine died: %s", self.kind, error)
        if self._on_dead is not None:
            self._on_dead(error)
        return True


class OutputStream:
    """The outputs of one engine request: what `Engine.generate` returns.

    The engine posts outputs with `put()` on the event loop, the first one given here (or put
    later, when None is given) and the last one final (finished, or carrying an error). A
    consumer takes them in one of two ways:
      * iterates the stream (`async for`): outputs wait in a queue until read;
      * or `attach(handler)` (the request pipeline): every output, those already waiting first,
        is handed to `handler` synchronously as the engine puts it, so an engine step that puts
        the outputs of all its requests in one event-loop callback has them all processed in
        that callback, without a task wake-up per request.
    `on_close(finished)` runs exactly once: when the final output is handed over
    (finished=True), or when the consumer closes the stream (or, iterating, is cancelled while
    waiting) before that (finished=False: the engine must abort the request). Closing a stream
    that was never iterated releases the request too, which a generator could not promise.
    """

    def __init__(self, first: EngineOutput | None, on_close: Callable[[bool], None]):
        self._queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        if first is not None:
            self._queue.put_nowait(first)
        self._on_close = on_close
        self._handler: Callable[[EngineOutput], None] | None = None
        self.closed = False

    def put(self, out: EngineOutput) -> None:
        """Hand an output to the attached handler, or queue it for the iterating consumer
        (dropped once the stream is closed)."""
        if self.closed:
            return
        handler = self._handler
        if handler is None:
            self._queue.put_nowait(out)
            return
        if out.finished or out.error is not None:
            self._close(finished=True)
        handler(out)

    def attach(self, handler: Callable[[EngineOutput], None]) -> None:
        """Hand every output to `handler` from now on (see the class docstring); outputs already
        waiting are handed over first, in order, before this returns. `handler` must not raise."""
        self._handler = handler
        while not self._queue.empty() and not self.closed:
            out = self._queue.get_nowait()
            if out.finished or out.error is not None:
                self._close(finished=True)
            handler(out)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self.closed:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self._close(finished=False)
            raise
        if out.finished or out.error is not None:
            self._close(finished=True)
        return out

    async def aclose(self) -> None:
        """Stop consuming; aborts the request unless its final output was handed over."""
        self.close()

    def close(self) -> None:
        """`aclose()` for synchronous callers (an attached consumer that went away)."""
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if not self.closed:
            self.closed = True
            self._on_close(finished)
            # The handler (a Job's bound method) holds the job that holds this stream: dropped,
            # a request's objects go as it ends, not in the garbage collector's next full pass.
            self._handler = None


def prompt_logprobs(
    logits: torch.Tensor | Sequence[Sequence[float]], prompt: Sequence[int], k: int, vocab: int | None = None
) -> list[PromptTokenInfo]:
    """The logprob of every prompt token given the ones before it, with `k` alternatives each.

    Args:
        logits: [len(prompt), V] raw logits of the prompt positions (a tensor or nested list;
            V may be padded past the vocabulary).
        prompt: the prompt's token ids.
        k: alternatives per token (0..20).
        vocab: alternatives are drawn from ids below this (None: all V columns).

    Returns:
        One PromptTokenInfo per prompt token; the first has no logprob (nothing precedes it).
    """
    import torch

    lp = torch.as_tensor(logits).float()[:-1].log_softmax(dim=-1)
    targets = torch.tensor(list(prompt[1:]), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in prompt[1:]]
    if k > 0 and len(targets):
        vals, idx = lp[:, :vocab].topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    out = [PromptTokenInfo(prompt[0], None, [])]
    out += [PromptTokenInfo(t, c, top) for t, c, top in zip(prompt[1:], chosen, tops, strict=True)]
    return out
