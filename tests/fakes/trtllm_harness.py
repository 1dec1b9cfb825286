"""Helpers that serve a TensorRT-LLM engine over its double through the real core on loopback."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.server import CoreServer, start_core
from tests.conftest import core_config
from tests.fakes.trtllm_executor import write_engine_dir


def make_engine_output(root: Path, tokenizer_dir: Path, **limits: Any) -> Path:
    """A build output as scripts/build_trtllm_engine.py leaves it: `engine/` plus a
    `trellis-engine.json` naming the tokenizer directory."""
    write_engine_dir(root / "engine", **limits)
    manifest = {"format": 1, "engine_dir": "engine", "tokenizer_dir": str(tokenizer_dir)}
    (root / "trellis-engine.json").write_text(json.dumps(manifest))
    return root


@contextlib.asynccontextmanager
async def serve_engine(
    build: Callable, model: Path, tokenizer, **overrides: Any
) -> AsyncIterator[tuple[CoreServer, spb_grpc.GenerateServiceStub]]:
    """Start a core whose engine comes from `build(config, tokenizer)` (an engine factory), on
    127.0.0.1:0; yields the server and a stub; stops both afterwards."""
    config = core_config(model, **overrides)
    engine = build(config, tokenizer)
    server = await start_core(config, engine=engine, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, spb_grpc.GenerateServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


async def collect(stub: spb_grpc.GenerateServiceStub, request: spb.GenerateRequest) -> list[spb.GenerateResponse]:
    """Every message of one Generate stream."""
    return [m async for m in stub.Generate(request)]


def tokens_of(messages, index: int = 0) -> list[int]:
    """Token ids of sequence `index`, concatenated over the stream."""
    return [t.id for m in messages for o in m.outputs if o.index == index for t in o.tokens]


def text_of(messages, index: int = 0) -> str:
    return "".join(o.text for m in messages for o in m.outputs if o.index == index)


def finish_of(messages, index: int = 0):
    """The last output of sequence `index` (carries finish_reason and stop fields)."""
    return [o for m in messages for o in m.outputs if o.index == index][-1]
