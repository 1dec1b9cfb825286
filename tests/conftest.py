"""Shared fixtures: a tiny model built locally, an in-process core on 127.0.0.1:0, gRPC stubs,
a factory that starts any gateway in-process against that core, and a factory of cores on the
mock engine (no model: for load, fleet and reliability tests)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.config import CoreConfig
from core.server import CoreServer, start_core
from core.tokenizer import Tokenizer
from gateways.common.app import start_app
from gateways.common.config import GatewayConfig, load

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def demo_script():
    """scripts/make_demo_model.py as a module (its constants and `main`)."""
    return _load_script("make_demo_model")


@pytest.fixture(scope="session")
def tiny_model_dir(demo_script, tmp_path_factory) -> Path:
    """An untrained demo-architecture model (same tokenizer and chat template), built once per session."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    rc = demo_script.main(["--output", str(out), "--steps", "0"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    """The tiny model's tokenizer, loaded once per test module."""
    return Tokenizer.load(tiny_model_dir)


@pytest.fixture(scope="session")
def tokenizer_only_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's tokenizer files alone (no config.json, no weights): enough for the mock engine."""
    out = tmp_path_factory.mktemp("tokenizer-only")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


@pytest.fixture
def collector_off() -> Iterator[Callable[..., Awaitable[list[str]]]]:
    """The cyclic garbage collector off for the test. Yields `left_behind(*types, mine=...)`:
    the type names of the objects of `types` that were made during the test and are still alive
    once handlers had up to 15 s to return (a reference cycle keeps them alive while the
    collector is off). `mine(obj)` narrows them to the test's own, where the session's event
    loop may serve other tests' leftovers meanwhile."""
    gc.collect()
    gc.disable()
    # By id and type, without holding the objects (a held object would hold whatever it comes to
    # reference): a new object at a freed one's address counts unless both have one type.
    before = {id(o): type(o) for o in gc.get_objects()}

    async def left_behind(*types: type, mine: Callable[[Any], bool] = lambda o: True) -> list[str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15.0
        while True:
            made = (o for o in gc.get_objects() if type(o) in types and before.get(id(o)) is not type(o) and mine(o))
            alive = [type(o).__name__ for o in made]
            if not alive or loop.time() > deadline:
                return alive
            await asyncio.sleep(0.05)

    try:
        yield left_behind
    finally:
        gc.enable()


#: Channel arguments of a test's own stand-in gRPC server: without SO_REUSEPORT (grpc's default
#: turns it on), as the core's own server (core.server.server_options), so a port chosen by the
#: system is never one another server of the session holds (grpc/grpc#10755).
NO_REUSEPORT = [("grpc.so_reuseport", 0)]


def core_config(model_dir: Path, **overrides: Any) -> CoreConfig:
    """A CoreConfig for tests: loopback, port 0, small limits, short drain. A test that starts
    an HF core of its own passes `engine_process=False` where it checks nothing of the engine
    process: the engine on a thread starts in about a second, the process in 5 to 10."""
    values: dict[str, Any] = dict(
        model=str(model_dir),
        host="127.0.0.1",
        port=0,
        max_batch_size=16,
        max_queue_size=256,
        threads=2,
        drain_seconds=1.0,
        model_name="tiny",
    )
    values.update(overrides)
    return CoreConfig(**values)


@pytest_asyncio.fixture(scope="session")
async def core(tiny_model_dir) -> AsyncIterator[CoreServer]:
    """The shared in-process core (HF engine on the tiny model), served as model 'tiny'."""
    server = await start_core(core_config(tiny_model_dir))
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(scope="session")
async def stub(core) -> AsyncIterator[spb_grpc.GenerateServiceStub]:
    """A GenerateService stub connected to the shared core."""
    channel = grpc.aio.insecure_channel(core.address)
    yield spb_grpc.GenerateServiceStub(channel)
    await channel.close()


GatewayFactory = Callable[..., Awaitable[str]]
MockCoreFactory = Callable[..., Awaitable[CoreServer]]


async def _mock_core(tiny_model_dir: Path, tokenizer: Tokenizer, **overrides: Any) -> CoreServer:
    values: dict[str, Any] = dict(engine="mock", model_name="mock", mock_step_ms=2.0, max_batch_size=64)
    values.update(overrides)
    return await start_core(core_config(tiny_model_dir, **values), tokenizer=tokenizer)


@pytest.fixture(scope="session")
def mock_tokenizer(tiny_model_dir) -> Tokenizer:
    """The tiny model's tokenizer, loaded once for every mock-engine core of the session."""
    return Tokenizer.load(tiny_model_dir)


@pytest_asyncio.fixture(scope="module")
async def start_mock_core(tiny_model_dir, mock_tokenizer) -> AsyncIterator[MockCoreFactory]:
    """Factory: `await start_mock_core(mock_step_ms=5, max_batch_size=4)` starts an in-process core
    on the mock engine (`--engine mock`, the tiny model's tokenizer, served as model 'mock') on
    127.0.0.1:0 and returns the running CoreServer. Keyword arguments override CoreConfig fields
    (defaults: 2 ms steps, EOS never drawn, batch 64, queue 256). Every core started is stopped
    at the end of the test module that started it; a test may stop one earlier with
    `await core.stop(0)`."""
    started: list[CoreServer] = []

    async def factory(**overrides: Any) -> CoreServer:
        server = await _mock_core(tiny_model_dir, mock_tokenizer, **overrides)
        started.append(server)
        return server

    yield factory
    for server in started:
        await server.stop(0)


@pytest_asyncio.fixture(scope="session")
async def mock_core(tiny_model_dir, mock_tokenizer) -> AsyncIterator[CoreServer]:
    """The shared in-process mock-engine core (2 ms steps, batch 64, served as model 'mock')."""
    server = await _mock_core(tiny_model_dir, mock_tokenizer)
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(scope="module")
async def start_gateway(core) -> AsyncIterator[GatewayFactory]:
    """Factory: `await start_gateway("openai", some_option=value, core=addr)` starts that gateway
    in-process on 127.0.0.1:0 and returns its base URL ("http://127.0.0.1:PORT"). Options are
    the gateway's own flags by argparse dest; common fields (core, request_timeout,
    max_body_bytes, ...) may be overridden too. Everything started is stopped at the end of the
    test module that started it, so no gateway outlives the module cores it was pointed at."""
    runners = []

    async def factory(name: str, **options: Any) -> str:
        module = importlib.import_module(f"gateways.{name}")
        common = {k: options.pop(k) for k in list(options) if k in GatewayConfig.__dataclass_fields__}
        defaults = _default_options(module)
        if name == "openai":
            # Requests without max_tokens keep the core's small default here: the gateway's own
            # default (the rest of a 1024-token context) is checked in test_gateway_openai_defaults.
            defaults["default_max_tokens"] = "core"
        defaults.update(options)
        config = GatewayConfig(
            name=name, core=common.pop("core", core.address), host="127.0.0.1", port=0, options=defaults, **common
        )
        runner, port = await start_app(module.make_app(config), "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield factory
    for runner in runners:
        await runner.cleanup()


def _default_options(module) -> dict[str, Any]:
    return dict(load(module.__name__.rsplit(".", 1)[-1], module.DEFAULT_PORT, module.add_arguments, [], {}).options)
