#!/usr/bin/env python
"""What one engine step's outputs cost on the pipe between the core and the HF engine process.

core.engine.hf_process sends every request's outputs of one engine step as one pickled message
(the hot path of the protocol: one message per step). This measures, per step of `--outputs`
outputs (a decode step: one new token per request, `--top-logprobs` alternatives each):
  encode   pack every output and pickle the message (the engine process's side)
  decode   unpickle the message and unpack every output (the core's side)
for these shapes of the message around the packed list:
  tuple      ("outputs", [packed, ...]): a kind tag and the payload
  dataclass  a frozen slots dataclass holding the packed list
  list       the packed list alone
  unpacked   a frozen slots dataclass holding the EngineOutput dataclasses themselves (no pack)
Pickling is multiprocessing.connection's (ForkingPickler, the default protocol). Each figure is
the fastest of `--repeat` runs of `--steps` steps, in µs per step, the shapes' runs interleaved:
the differences between shapes are a few µs a message, which preemption on a shared machine
would drown in a mean or median. `--root` measures the pack and unpack of another checkout
(before/after).

Prints progress to stderr, a table, and one JSON object on its last line. Usage:
  python scripts/bench/engine_messages.py [--outputs 32 256] [--top-logprobs 0] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Wrapped:
    """A message holding one step's outputs (packed or not)."""

    outputs: list[Any]


def decode_step(n: int, top: int) -> list[Any]:
    """One decode step's outputs: `n` requests, one new token each (with `top` alternatives)."""
    from core.types import EngineOutput, SequenceStep

    now = time.monotonic()
    outs = []
    for i in range(n):
        token = 1000 + i
        lps = [-0.25] if top else None
        tops = [[(token + k, -0.25 - k) for k in range(top)]] if top else None
        outs.append(EngineOutput(f"req-{i:06d}", sequences=[SequenceStep(0, [token], lps, tops)], time=now + i * 1e-6))
    return outs


def shapes(hf_process: Any) -> dict[str, tuple[Callable[[list[Any]], Any], Callable[[Any], list[Any]], bool]]:
    """Message shape name -> (wrap a step, the step list of a received message, packed)."""
    out: dict[str, tuple[Callable[[list[Any]], Any], Callable[[Any], list[Any]], bool]] = {
        "tuple": (lambda step: ("outputs", step), lambda m: m[1], True),
        "dataclass": (Wrapped, lambda m: m.outputs, True),
        "list": (lambda step: step, lambda m: m, True),
    }
    out["unpacked"] = (Wrapped, lambda m: m.outputs, False)
    return out


def measure(outs: list[Any], hf_process: Any, shape: tuple[Any, Any, bool], steps: int) -> tuple[float, float]:
    """(encode, decode) µs per step of one run of `steps` steps."""
    wrap, unwrap, packed = shape
    pack, unpack, dumps, loads = hf_process.pack, hf_process.unpack, ForkingPickler.dumps, ForkingPickler.loads
    t0 = time.perf_counter()
    for _ in range(steps):
        data = dumps(wrap([pack(o) for o in outs] if packed else outs))
    t1 = time.perf_counter()
    for _ in range(steps):
        received = unwrap(loads(data))
        result = [unpack(p) for p in received] if packed else received
    t2 = time.perf_counter()
    assert result == outs
    return (t1 - t0) / steps * 1e6, (t2 - t1) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--outputs", type=int, nargs="+", default=[32, 256], help="outputs per step")
    p.add_argument("--top-logprobs", type=int, default=0, help="alternatives per token (0: no logprobs)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (0: 2000 outputs per run)")
    p.add_argument("--repeat", type=int, default=60, help="runs per figure (the fastest is reported)")
    p.add_argument("--root", default=str(ROOT), help="the checkout whose core.engine.hf_process is measured")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.root).resolve()))
    from core.engine import hf_process

    print(f"measuring {hf_process.__file__}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    kinds = shapes(hf_process)
    for n in args.outputs:
        outs = decode_step(n, args.top_logprobs)
        steps = args.steps or max(4, 2000 // n)
        print(f"{n} outputs: {args.repeat} runs of {steps} steps per shape", file=sys.stderr, flush=True)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
        for _ in range(args.repeat):
            for name, shape in kinds.items():
                runs[name].append(measure(outs, hf_process, shape, steps))
        for name, shape in kinds.items():
            size = len(ForkingPickler.dumps(shape[0]([hf_process.pack(o) for o in outs] if shape[2] else outs)))
            enc, dec = min(r[0] for r in runs[name]), min(r[1] for r in runs[name])
            rows.append({"outputs": n, "shape": name, "encode_us": enc, "decode_us": dec, "bytes": size})

    head = ("outputs", "shape", "encode µs", "decode µs", "total µs", "vs tuple", "bytes")
    print("\n{:>7}  {:<10} {:>10} {:>10} {:>10} {:>8} {:>7}".format(*head))
    for row in rows:
        base = next(r for r in rows if r["outputs"] == row["outputs"] and r["shape"] == "tuple")
        total, base_total = row["encode_us"] + row["decode_us"], base["encode_us"] + base["decode_us"]
        print(
            f"{row['outputs']:>7}  {row['shape']:<10} {row['encode_us']:>10.1f} {row['decode_us']:>10.1f} "
            f"{total:>10.1f} {(total / base_total - 1) * 100:>+7.1f}% {row['bytes']:>7}"
        )
    print(json.dumps({"root": str(Path(args.root).resolve()), "top_logprobs": args.top_logprobs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
