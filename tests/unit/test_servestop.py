"""SIGTERM or SIGINT -> drain -> return (servestop), as the core and every gateway stop: on this
test process's own event loop, with real signals sent to itself. The processes' drains under
load: tests/reliability/test_drain.py (the core), tests/integration/test_haproxy.py (a gateway).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

import servestop


async def _started(drain) -> asyncio.Task[signal.Signals]:
    """drain_on_signal(drain) as a task that has installed its handlers."""
    task = asyncio.ensure_future(servestop.drain_on_signal(drain))
    await asyncio.sleep(0)  # the task runs up to its wait for a signal
    return task


def _defaults_restored() -> bool:
    """SIGINT raises KeyboardInterrupt again, SIGTERM ends the process again."""
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    return sigint is signal.default_int_handler and sigterm == signal.SIG_DFL


@pytest.mark.parametrize("sig", servestop.STOP_SIGNALS)
async def test_the_signal_starts_the_drain(sig):
    drained: list[str] = []

    async def drain() -> None:
        drained.append("drained")

    task = await _started(drain)
    await asyncio.sleep(0)
    assert drained == [] and not task.done()
    os.kill(os.getpid(), sig)
    assert await task == sig
    assert drained == ["drained"]
    assert _defaults_restored()


async def test_a_second_signal_during_the_drain_does_not_cut_it_short():
    steps: list[str] = []

    async def drain() -> None:
        steps.append("started")
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)  # the loop handles both signals meanwhile
        steps.append("finished")

    task = await _started(drain)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await task == signal.SIGTERM
    assert steps == ["started", "finished"]
    assert _defaults_restored()


async def test_a_failing_drain_raises_and_the_handlers_are_removed():
    async def drain() -> None:
        raise OSError("the drain failed")

    task = await _started(drain)
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(OSError, match="the drain failed"):
        await task
    assert _defaults_restored()


def test_off_the_main_thread_it_refuses():
    errors: list[BaseException] = []

    async def drain() -> None:
        raise AssertionError("never drained")

    def run() -> None:
        try:
            asyncio.run(servestop.drain_on_signal(drain))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert _defaults_restored()
