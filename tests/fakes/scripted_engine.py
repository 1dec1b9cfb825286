"""An engine double that plays a script, for the core's paths that only a broken or slow engine
reaches (an engine that stalls, an unexpected exception, a request held open on purpose).

It implements core.engine.base.Engine at token level, so the pipeline, service and server
around it are the real ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from core.engine.base import EngineLifecycle, OutputStream
from core.sampling import resolve_generic
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

Script = Callable[[EngineRequest], list[EngineOutput]]


def tokens_then_length(tokens: list[int]) -> Script:
    """A script: QUEUED, one output per token, the last one finished with LENGTH."""

    def play(req: EngineRequest) -> list[EngineOutput]:
        outs = [EngineOutput(req.request_id, sequences=[SequenceStep(0, [t])]) for t in tokens]
        outs[-1].sequences[0].finish_reason = FinishReason.LENGTH
        outs[-1].finished = True
        return outs

    return play


class ScriptedEngine(EngineLifecycle):
    """Every request plays `script(request)` after its QUEUED output.

    Args:
        vocab_size: the served tokenizer's vocabulary size.
        script: the outputs of a request (their request ids are the request's), or raises to
            refuse it at admission.

    Attributes:
        gate: while cleared, requests wait after QUEUED (set by default).
        requests: every EngineRequest admitted, in order.
        aborted: request ids whose consumer left before the end.
    """

    kind = "scripted"

    def __init__(self, vocab_size: int, script: Script):
        super().__init__()
        self.info = EngineInfo(engine=self.kind, max_context_length=1024, vocab_size=vocab_size)
        self.script = script
        self.gate = asyncio.Event()
        self.gate.set()
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self._active = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._started = self._alive = True

    async def shutdown(self) -> None:
        self._stopping = True
        self._alive = False

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        return resolve_generic(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        return EngineStats(active=self._active, queued=0)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def generate(self, request: EngineRequest) -> OutputStream:
        self._check_serving()
        outputs = self.script(request)
        self.requests.append(request)
        self._active += 1

        def on_close(finished: bool) -> None:
            self._active -= 1
            if not finished:
                self.abort(request.request_id)

        stream = OutputStream(EngineOutput(request.request_id, state=RequestState.QUEUED), on_close)
        task = asyncio.ensure_future(self._play(request, outputs, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _play(self, request: EngineRequest, outputs: list[EngineOutput], stream: OutputStream) -> None:
        await self.gate.wait()
        for out in outputs:
            out.request_id = request.request_id
            stream.put(out)
