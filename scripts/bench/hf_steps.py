#!/usr/bin/env python
"""Where the HF engine's time goes, step by step, next to the model's own static batch.

Runs core.engine.hf.HfEngine in this process (on its worker thread, no gRPC, no pipeline) under
a closed loop of `--streams` streams (the load generator's prompts, greedy, `--max-new-tokens`
new tokens, EOS ignored), and then scripts/bench/static_batch.py's padded static batch of the
same size, both with the same torch threads. Every model forward is timed and classified:
  prefill   new prompts only (the engine's prefill groups; the static batch's first forward)
  decode    one token per running row
  mixed     running rows' decode tokens and new prompts' tokens in one forward
Per kind: forwards, sequences and tokens per forward, ms per forward (mean and p50) and the
share of the wall time; plus forwards per generated token, which is what a schedule changes.
`--arrival-ms` has each stream wait a quarter to all of that (by stream) before its next
request, as a closed loop's round trip through gRPC spreads arrivals; `--root` runs the engine
of another checkout (before/after); `--trace FILE` sums up a core's `--hf-step-trace` instead
(ms per forward, shares of the steps' total time, and the step time outside the forward).

Prints a table and one JSON object on its last line. Usage:
  python scripts/bench/hf_steps.py --streams 16 [--seconds 8] [--threads 0] [--arrival-ms 0] [--root DIR]
  python scripts/bench/hf_steps.py --trace steps.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import PROMPTS
from procs import ROOT
from static_batch import padded_batch


def classify(inputs: dict[str, Any]) -> tuple[str, int, int]:
    """(kind, sequences, tokens) of one forward of the HF engine (a packed step with its
    slot_plan, or an older engine's padded prefill or decode) or of model.generate."""
    plan = inputs.get("slot_plan")
    if plan is not None:
        prompts = 0 if plan.prefill_gather is None else plan.prefill_gather.shape[0]
        kind = "mixed" if plan.decode_rows and prompts else "decode" if plan.decode_rows else "prefill"
        return kind, plan.decode_rows + prompts, int(inputs["input_ids"].shape[1])
    rows, width = inputs["input_ids"].shape
    if width == 1:
        return "decode", rows, rows
    mask = inputs.get("attention_mask")
    return "prefill", rows, int(mask.sum()) if mask is not None and mask.dim() == 2 else rows * width


class _Timed:
    """A model whose forwards are timed and classified."""

    def __init__(self, model: Any, log: list[tuple[str, int, int, float]]):
        self.model, self.log = model, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self.model(**kw)
        self.log.append((*classify(kw), time.perf_counter() - t0))
        return out


def summarize(forwards: list[tuple[str, int, int, float]], wall: float, generated: int) -> dict[str, Any]:
    """Per kind: count, mean rows and tokens per forward, mean ms, share of wall time."""
    by: dict[str, list[tuple[str, int, int, float]]] = collections.defaultdict(list)
    for f in forwards:
        by[f[0]].append(f)
    kinds = {}
    for kind, fs in sorted(by.items()):
        kinds[kind] = {
            "forwards": len(fs),
            "rows": round(statistics.fmean(f[1] for f in fs), 2),
            "tokens": round(statistics.fmean(f[2] for f in fs), 2),
            "ms": round(1000 * statistics.fmean(f[3] for f in fs), 3),
            "ms_p50": round(1000 * statistics.median(f[3] for f in fs), 3),
            "share": round(sum(f[3] for f in fs) / wall, 3),
        }
    return {
        "wall_s": round(wall, 3),
        "generated": generated,
        "tokens_per_s": round(generated / wall, 1),
        "forwards_per_token": round(len(forwards) / max(1, generated), 4),
        "forward_share": round(sum(f[3] for f in forwards) / wall, 3),
        "kinds": kinds,
    }


async def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The closed loop against HfEngine on its worker thread."""
    from core.engine.hf import HfEngine
    from core.engine.hf_config import default_threads
    from core.sampling import resolve_generic
    from core.tokenizer import Tokenizer
    from core.types import EngineRequest, SamplingOptions

    tok = Tokenizer.load(args.model)
    extra = json.loads(args.engine_kwargs) if args.engine_kwargs else {}
    engine = HfEngine(
        args.model,
        eos_token_ids=tok.eos_token_ids,
        vocab_size=tok.vocab_size,
        pad_token_id=tok.pad_token_id,
        max_batch_size=max(32, args.streams),
        threads=default_threads(args.threads),
        **extra,
    )
    await engine.start()
    log: list[tuple[str, int, int, float]] = []
    engine._model = _Timed(engine._model, log)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = resolve_generic(SamplingOptions(), random_seed=1)
    counter = 0
    generated = 0
    measuring = False
    stop_at = 0.0

    async def stream(w: int) -> None:
        nonlocal counter, generated
        i = w
        while time.perf_counter() < stop_at:
            counter += 1
            req = EngineRequest(
                f"r{counter}", prompts[i % len(prompts)], sampling, args.max_new_tokens, ignore_eos=True
            )
            i += 1
            async for out in engine.generate(req):
                if measuring:
                    generated += sum(len(s.token_ids) for s in out.sequences)
            if args.arrival_ms:
                await asyncio.sleep(args.arrival_ms / 1000 * (w % 4 + 1) / 4)

    stop_at = time.perf_counter() + args.warmup + args.seconds + 600
    tasks = [asyncio.create_task(stream(w)) for w in range(args.streams)]
    await asyncio.sleep(args.warmup)
    log.clear()
    measuring = True
    t0 = time.perf_counter()
    await asyncio.sleep(args.seconds)
    measuring = False
    wall = time.perf_counter() - t0
    forwards = list(log)
    stop_at = 0.0
    await asyncio.gather(*tasks)
    await engine.shutdown()
    return summarize(forwards, wall, generated)


def run_static(args: argparse.Namespace) -> dict[str, Any]:
    """static_batch.py's padded static batches, each forward timed."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.engine.hf_config import default_threads
    from core.tokenizer import Tokenizer

    torch.set_num_threads(default_threads(args.threads))
    tok = Tokenizer.load(args.model)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts = [tok.encode(p) for p in PROMPTS]
    log: list[tuple[str, int, int, float]] = []
    original = model.forward

    def forward(*a: Any, **kw: Any) -> Any:
        ids = kw["input_ids"]
        t0 = time.perf_counter()
        out = original(*a, **kw)
        dt = time.perf_counter() - t0
        rows, width = ids.shape
        mask = kw.get("attention_mask")
        if width == 1 and kw.get("past_key_values") is not None and kw["past_key_values"].get_seq_length() > 1:
            log.append(("decode", rows, rows, dt))
        else:
            log.append(("prefill", rows, int(mask.sum()) if mask is not None else rows * width, dt))
        return out

    model.forward = forward
    batch = args.streams

    def one(b: int) -> int:
        ids, mask = padded_batch(prompts, batch, b, pad)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return (out.shape[1] - ids.shape[1]) * batch

    one(0)
    log.clear()
    t0 = time.perf_counter()
    generated, b = 0, 0
    while time.perf_counter() - t0 < args.seconds:
        b += 1
        generated += one(b)
    wall = time.perf_counter() - t0
    return summarize(log, wall, generated)


def show(label: str, s: dict[str, Any]) -> None:
    print(
        f"{label:8} {s['tokens_per_s']:8.0f} tok/s  {s['forwards_per_token']:.4f} forwards/token  "
        f"forwards {100 * s['forward_share']:.0f}% of wall",
        flush=True,
    )
    for kind, k in s["kinds"].items():
        print(
            f"   {kind:8} {k['forwards']:5d} x  rows {k['rows']:6.2f}  tokens {k['tokens']:7.2f}  "
            f"{k['ms']:7.2f} ms (p50 {k['ms_p50']:6.2f})  {100 * k['share']:4.1f}% of wall",
            flush=True,
        )


def show_trace(path: Path) -> int:
    """Per kind: the steps of a core's step trace (lines "kind sequences tokens forward_seconds
    step_seconds"; older traces have no step seconds), and the step time outside the forward:
    per step and per generated token (sampling, logprobs, admission, handing outputs over)."""
    forwards = []
    steps = 0.0
    for line in path.read_text().splitlines():
        kind, rows, tokens, seconds, *step = line.split()
        forwards.append((kind, int(rows), int(tokens), float(seconds)))
        steps += float(step[0]) if step else float(seconds)
    busy = sum(f[3] for f in forwards)
    generated = sum(f[1] for f in forwards)  # every step makes one token per sequence in it
    s = summarize(forwards, steps, generated)
    s["outside_forward"] = {
        "ms_per_step": round(1000 * (steps - busy) / max(1, len(forwards)), 3),
        "us_per_token": round(1e6 * (steps - busy) / max(1, generated), 1),
    }
    show("trace", s)
    out = s["outside_forward"]
    print(f"   outside the forward: {out['ms_per_step']:.3f} ms per step, {out['us_per_token']:.1f} µs per token")
    print(json.dumps(s))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models/demo"))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    p.add_argument("--arrival-ms", type=float, default=0.0, help="delay before a stream's next request")
    p.add_argument("--engine-kwargs", default="", help="extra HfEngine keyword arguments, as JSON")
    p.add_argument("--only", choices=["engine", "static"], default=None)
    p.add_argument("--root", default=str(ROOT), help="the checkout whose engine runs (a before/after comparison)")
    p.add_argument(
        "--trace", default="", metavar="FILE", help="summarize a core's --hf-step-trace file instead of running"
    )
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.root).resolve()))
    if args.trace:
        return show_trace(Path(args.trace))
    result: dict[str, Any] = {"streams": args.streams}
    if args.only != "static":
        result["engine"] = asyncio.run(run_engine(args))
        show("engine", result["engine"])
    if args.only != "engine":
        result["static"] = run_static(args)
        show("static", result["static"])
    if "engine" in result and "static" in result:
        result["ratio"] = round(result["engine"]["tokens_per_s"] / result["static"]["tokens_per_s"], 3)
        print(f"engine / static = {result['ratio']:.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
