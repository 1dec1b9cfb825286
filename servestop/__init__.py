"""How a serving process stops (the core and every gateway): SIGTERM (Kubernetes ending a pod,
`docker stop`) or SIGINT (Ctrl-C) starts the process's drain, and the process exits once the
drain has returned.

`drain_on_signal(drain)` waits on the running event loop (asyncio's or uvloop's) for the first
of those signals, then awaits `drain()`: the core's (core.server.CoreServer.stop) or a
gateway's (gateways.common.drain.drain). Its handlers stay installed until the drain returns,
so a second signal (a repeated Ctrl-C, a second SIGTERM) is ignored rather than cutting the
drain short: the drain keeps to its own deadline (`--drain-seconds`), and SIGKILL, which a
Kubernetes kubelet sends once terminationGracePeriodSeconds are over, still ends the process at
once. Standard library only, like envflags, so both islands install it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

__all__ = ["STOP_SIGNALS", "drain_on_signal"]

#: The signals that start a drain.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def drain_on_signal(drain: Callable[[], Awaitable[object]]) -> signal.Signals:
    """Wait for the first of STOP_SIGNALS, then await `drain()`; returns the signal received.

    The signals' handlers are removed once `drain()` has returned or raised (SIGINT raises
    KeyboardInterrupt again, SIGTERM ends the process again).

    Raises:
        RuntimeError (asyncio's loop) or ValueError (uvloop's): not called on the main thread,
            the only one that receives signals (`loop.add_signal_handler`).
        Exception: whatever `drain()` raises.
    """
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not received.done():
            received.set_result(sig)

    installed = []
    try:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        sig = await received
        await drain()
        return sig
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
