"""`trellis-gateway <lmi|openai|triton|ws> [flags]`: run one gateway process until SIGTERM or
SIGINT, then drain (servestop, gateways.common.drain).

Each gateway package is a gateways.common.app.Gateway: DEFAULT_PORT, add_arguments(parser) and
make_app(config).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from typing import cast

import logclip
import servegc
import servestop
from gateways.common.app import Gateway, start_app
from gateways.common.config import GatewayConfig, load
from gateways.common.drain import drain
from gateways.common.tls import server_ssl_context

GATEWAYS = ("lmi", "openai", "triton", "ws")
log = logging.getLogger("gateways")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in GATEWAYS:
        print(
            f"usage: trellis-gateway {{{','.join(GATEWAYS)}}} [flags]  (--help after the name for flags)",
            file=sys.stderr,
        )
        return 2
    name = argv[0]
    module = cast(Gateway, importlib.import_module(f"gateways.{name}"))
    config = load(name, module.DEFAULT_PORT, module.add_arguments, argv[1:])
    logclip.configure(config.log_level)
    log.info(
        "effective configuration: %s",
        json.dumps(config.redacted(), sort_keys=True, default=str),
    )
    return asyncio.run(_serve(config, module))


async def _serve(config: GatewayConfig, module: Gateway) -> int:
    try:
        app = module.make_app(config)
        context = server_ssl_context(config)
        runner, port = await start_app(app, config.host, config.port, context)
    except (ValueError, OSError) as e:
        log.error("trellis-gateway %s cannot start: %s", config.name, e)
        return 2
    servegc.settle()
    scheme = "https" if context else "http"
    print(f"trellis-gateway {config.name} on {scheme}://{config.host}:{port} -> core {config.core}", flush=True)
    await servestop.drain_on_signal(lambda: drain(app, runner, config.drain_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
