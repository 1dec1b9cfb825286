"""`trellis-core` / `python -m core`: serve one model over the gRPC Generate API until SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

import uvloop

import logclip
import servegc
from core.config import CoreConfig, load
from core.server import start_core

log = logging.getLogger("core")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (2: bad configuration or missing dependency)."""
    config = load(argv)
    # The engine's batching thread and the event loop share the GIL; a shorter switch interval
    # hands it back to the batching thread sooner after the loop has sent a step's tokens.
    sys.setswitchinterval(0.001)
    logclip.configure(config.log_level)
    log.info("effective configuration: %s", json.dumps(config.redacted(), sort_keys=True))
    try:
        if config.engine == "trtllm":  # MPI ranks > 0 of a multi-GPU engine serve no gRPC
            from core.engine.trtllm.executor import run_if_follower_rank

            if run_if_follower_rank(config):
                return 0
        # uvloop's event loop costs less per callback and per socket write than asyncio's, and the
        # loop runs once per engine step for every stream (scripts/bench/overhead.py).
        return uvloop.run(_serve(config))
    except (RuntimeError, OSError, ValueError) as e:
        log.error("trellis-core cannot start: %s", e)
        return 2


async def _serve(config: CoreConfig) -> int:
    core = await start_core(config)
    servegc.settle()
    print(f"trellis-core serving '{config.served_model_name}' ({config.engine}) on {core.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining for up to %.0f s", config.drain_seconds)
    await core.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
