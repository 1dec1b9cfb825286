#!/usr/bin/env python
"""The model's own batch speed: a padded static batch through `model.generate`, in one process.

The comparator of the HF engine's throughput goal (core tokens/s at 16 and 32 streams
>= 0.9x this figure at the same batch size). It runs what the core's HF engine runs, without any
serving around it: the same checkpoint, dtype (float32 on CPU) and torch thread count, greedy,
`max_new_tokens` new tokens per row with EOS ignored (the generation config's EOS ids are
cleared, as the load generator's `ignore_eos` does for the core), the load generator's prompts
(tokenized as the core tokenizes a text prompt) left-padded into batches of `--batch` rows.

After one unmeasured batch, `--batches` batches run back to back; the figures are:
  tokens_per_s   rows x new tokens of every measured batch / their wall time (prefill included,
                 as a closed loop's steady state includes one prefill per request)
  ttft_ms        per batch, generate() called -> first logits processed (the prefill), p50
  itl_ms         gaps between successive decode steps (the time between two tokens of a row), p50
  others_cores   CPU the rest of the machine used meanwhile, in cores (a disturbed run shows it)

`--cpus LIST` runs it on those CPUs only (run_all.py gives it the CPUs the core's engine process
gets, so both sides of the comparison run their model on the same CPUs).

Prints one JSON object on its last line. Usage:
  python scripts/bench/static_batch.py --model models/demo --batch 16 [--batches 4] [--threads 0] [--cpus 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil
from loadgen import PROMPTS
from overhead import _busy_cpu_seconds
from procs import ROOT


class _StepClock:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def padded_batch(prompts: list[list[int]], batch: int, b: int, pad: int) -> tuple[Any, Any]:
    """Batch number `b`: `batch` prompts taken in turn, left-padded; (ids, attention mask),
    each [batch, longest prompt]."""
    import torch

    rows = [prompts[(b * batch + i) % len(prompts)] for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def run_static(model_dir: str, batch: int, batches: int, max_new_tokens: int, threads: int) -> dict[str, Any]:
    """Measure `batches` padded static batches of `batch` rows (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from core.tokenizer import Tokenizer

    if threads > 0:
        torch.set_num_threads(threads)
    tokenizer = Tokenizer.load(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: every row makes max_new_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    def one(b: int) -> tuple[float, list[float], int]:
        ids, mask = padded_batch(prompts, batch, b, pad)
        clock = _StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        wall = time.perf_counter() - t0
        steps = [t0, *clock.times]
        return wall, [b - a for a, b in itertools.pairwise(steps)], (out.shape[1] - ids.shape[1]) * batch

    one(0)  # warm-up: allocator, MKL, first-call paths
    me = psutil.Process()
    busy0, mine0 = _busy_cpu_seconds(), me.cpu_times()
    walls, ttft, itl, tokens = [], [], [], 0
    for b in range(batches):
        wall, gaps, made = one(b + 1)
        walls.append(wall)
        ttft.append(gaps[0])
        itl += gaps[1:]
        tokens += made
    busy1, mine1 = _busy_cpu_seconds(), me.cpu_times()
    others = (busy1 - busy0) - ((mine1.user + mine1.system) - (mine0.user + mine0.system))
    return {
        "batch": batch,
        "batches": batches,
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "wall_s": round(sum(walls), 4),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / sum(walls), 1),
        "ttft_ms": {"p50": round(1000 * statistics.median(ttft), 3)},
        "itl_ms": {"p50": round(1000 * statistics.median(itl), 3)},
        "others_cores": round(max(0.0, others) / sum(walls), 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--batch", type=int, default=16, help="rows per batch (the streams compared against)")
    p.add_argument("--batches", type=int, default=4, help="measured batches")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--cpus", default="", help="CPU list to run on (e.g. 1 or 2-3; default: any)")
    args = p.parse_args(argv)
    if args.cpus:
        sys.path.insert(0, str(ROOT))
        from core.engine.hf_config import parse_cpu_list

        os.sched_setaffinity(0, parse_cpu_list(args.cpus))  # before torch starts any thread
    result = run_static(args.model, args.batch, args.batches, args.max_new_tokens, args.threads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
