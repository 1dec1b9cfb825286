"""The token-level engine protocol every engine implements.

Engines batch requests in flight and stream token ids with logprobs; everything textual
(templates, detokenization, stop strings, sessions) lives in the request pipeline. Engines see
only `core.types` dataclasses, never protobuf.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from core.types import EngineInfo, EngineOutput, EngineRequest, EngineStats, ResolvedSampling, SamplingOptions


class Engine(Protocol):
    """An in-flight batching engine.

    Contract of `generate`:
      * raises `core.errors.Overloaded` (before yielding) when its queue is full, and
        `core.errors.NotReady` / `EngineDead` when it cannot take requests;
      * yields an output with state QUEUED first, then SCHEDULED and PREFILLED when known
        (an engine that cannot observe them may skip them; the pipeline fills them in), then
        token outputs; the last output has `finished=True` or carries `error`;
      * when the consumer stops early (the async generator is closed or cancelled), the request
        is aborted within one engine step and its resources are freed.
    """

    info: EngineInfo

    async def start(self) -> None:
        """Load the model and start the batching loop."""

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """Apply this engine's defaults to unset fields (a pure function of the arguments)."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run one request; see the class docstring for the output contract."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when unknown or finished); takes effect within one step."""

    def stats(self) -> EngineStats:
        """Requests running and waiting right now."""

    @property
    def alive(self) -> bool:
        """False once the engine can serve no more requests."""

    def set_on_dead(self, callback: Callable[[Exception], None]) -> None:
        """Register the callback invoked (on the event loop) when the engine dies."""

    async def shutdown(self) -> None:
        """Stop the loop and free the model; pending requests fail with NotReady."""
