"""`trellis-core` / `python -m core`: serve one model over the gRPC Generate API until SIGTERM
or SIGINT, then drain (servestop, core.server.CoreServer.stop)."""

from __future__ import annotations

import json
import logging
import sys

import uvloop

import logclip
import servegc
import servestop
from core.config import CoreConfig, load
from core.server import CoreServer, start_core

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
    await servestop.drain_on_signal(lambda: _drain(core))
    return 0


async def _drain(core: CoreServer) -> None:
    log.info("draining for up to %.0f s", core.config.drain_seconds)
    await core.stop()
    log.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
