"""`make bench` section `lora`, fleet part: how many requests for LoRA adapters reach a core
that holds their adapter, with three cores behind one OpenAI gateway, under `--routing prefix`
(adapter affinity: gateways.common.prefix_route) and under `--routing round_robin`.

Three mock-engine cores (`--max-loras 2`, 10 ms steps) register the same six adapters; the
gateway and the cores run in this process, so each core's engine is watched as it is given
requests. A closed loop of `--streams` clients sends `--requests` completions (8 new tokens,
EOS never drawn), each for an adapter drawn at random (seeded): `uniform` over the six, and
`skewed` with weights 8, 4, 2, 1, 1, 1 (one adapter gets 47 % of the requests).

Residency: each mock core keeps its adapters in `--max-loras` slots under the HF engine's rule
(core.lora.AdapterSlots: the least recently used idle adapter evicted for a new one, a request
waiting when every slot runs another adapter). A request **hits** when its adapter was in a slot
of its core when it was admitted; each placement into a slot (`AdapterSlots.loads`) is a miss,
and the first request for each adapter on each core is one. Also reported: on how many cores
each adapter was served, and the busiest core's share of the requests.

Usage: python scripts/bench/lora_fleet.py [--model models/demo] [--requests 600] [--streams 12]
           [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "gen/python")]

from core.config import CoreConfig  # noqa: E402
from core.server import CoreServer, start_core  # noqa: E402
from gateways import openai as openai_gateway  # noqa: E402
from gateways.common.app import start_app  # noqa: E402
from gateways.common.config import load  # noqa: E402

ADAPTERS = tuple(f"ft-{i}" for i in range(6))
WORKLOADS = {"uniform": (1, 1, 1, 1, 1, 1), "skewed": (8, 4, 2, 1, 1, 1)}
SLOTS = 2


def write_adapters(root: Path) -> tuple[tuple[str, str], ...]:
    """Six adapter directories for the mock engine (it reads adapter_config.json alone)."""
    modules = []
    for name in ADAPTERS:
        (root / name).mkdir(parents=True)
        config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        (root / name / "adapter_config.json").write_text(json.dumps(config))
        (root / name / "adapter_model.safetensors").write_bytes(b"")
        modules.append((name, str(root / name)))
    return tuple(modules)


def watch(core: CoreServer) -> list[str]:
    """The adapters `core`'s engine is given, in arrival order."""
    seen: list[str] = []
    generate = core.engine.generate

    def recording(request: Any) -> Any:
        seen.append(request.adapter)
        return generate(request)

    core.engine.generate = recording  # type: ignore[method-assign]
    return seen


async def run(model: str, modules: tuple[tuple[str, str], ...], routing: str, workload: str, args) -> dict:
    """One setup: fresh cores and gateway, the closed loop, the figures."""
    cores = []
    for _ in range(3):
        config = CoreConfig(
            model=model,
            engine="mock",
            model_name="demo",
            host="127.0.0.1",
            port=0,
            mock_step_ms=10.0,
            max_batch_size=64,
            lora_modules=modules,
            max_loras=SLOTS,
            log_level="WARNING",
        )
        cores.append(await start_core(config))
    seen = [watch(c) for c in cores]
    argv = ["--host", "127.0.0.1", "--port", "0", "--core", ",".join(c.address for c in cores), "--routing", routing]
    config = load("openai", openai_gateway.DEFAULT_PORT, openai_gateway.add_arguments, argv, {})
    runner, port = await start_app(openai_gateway.make_app(config), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rng = random.Random(7)
    draws = rng.choices(ADAPTERS, WORKLOADS[workload], k=args.requests)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"model": "demo", "prompt": "warm", "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
            for s in seen:
                s.clear()
            loads = [c.engine._slots.loads for c in cores]
            queue = iter(enumerate(draws))

            async def client() -> None:
                for i, name in queue:
                    body = {"model": name, "prompt": f"Request {i}.", "max_tokens": 8, "ignore_eos": True}
                    async with http.post(url, json=body) as r:
                        if r.status != 200:
                            raise SystemExit(f"lora fleet: {r.status} {await r.text()}")

            await asyncio.gather(*(client() for _ in range(args.streams)))
    finally:
        await runner.cleanup()
        for c in cores:
            await c.stop(0)
    served = sum(len(s) for s in seen)
    misses = sum(c.engine._slots.loads for c in cores) - sum(loads)
    where = collections.defaultdict(set)
    for i, s in enumerate(seen):
        for name in s:
            where[name].add(i)
    return {
        "requests": served,
        "resident_share": round(1 - misses / served, 4),
        "cores_per_adapter": {name: len(where[name]) for name in ADAPTERS},
        "busiest_core_share": round(max(len(s) for s in seen) / served, 3),
    }


async def main_async(args) -> dict:
    model = str(ROOT / args.model)
    out: dict[str, Any] = {
        "setup": {
            "cores": 3,
            "max_loras": SLOTS,
            "adapters": len(ADAPTERS),
            "streams": args.streams,
            "requests": args.requests,
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        modules = write_adapters(Path(tmp))
        for workload in WORKLOADS:
            for routing in ("prefix", "round_robin"):
                figures = await run(model, modules, routing, workload, args)
                out[f"{workload}_{'affinity' if routing == 'prefix' else routing}"] = figures
                print(f"  {workload:8s} {routing:12s} {json.dumps(figures)}", flush=True)
    return out


def run_lora_fleet(model: str, requests: int = 600, streams: int = 12) -> dict:
    """The fleet part of the `lora` section of summary.json."""
    print(f"== lora: fleet, {requests} requests over 6 adapters and 3 cores of 2 slots", flush=True)
    return asyncio.run(main_async(argparse.Namespace(model=model, requests=requests, streams=streams)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo", help="the model directory (its tokenizer serves the mock)")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    figures = run_lora_fleet(args.model, args.requests, args.streams)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
