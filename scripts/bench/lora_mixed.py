#!/usr/bin/env python
"""Mixed-adapter batches: peft's `adapter_names=` against core.engine.hf_lora's slot groups.

The same model, the same padded batch of `--rows` rows (a prompt of `--prompt` tokens each,
rows cycling over `--adapters` random rank-`--rank` adapters on every Linear layer and the base
model), the same greedy loop of `--new` decode steps with transformers' cache:
  base     the model alone (no adapter anywhere)
  peft     a PeftModel holding every adapter, each forward given `adapter_names` per row
           (peft's mixed-batch inference, LoraLayer._mixed_batch_forward)
  slots    the model's Linear layers wrapped by core.engine.hf_lora.LoraBank (one slot per
           adapter), each forward's tokens grouped by slot
and checks that peft and slots pick the same tokens. Figures are tokens per second (rows x new
tokens over the loop's time), the best of `--repeat` runs, runs interleaved.

Prints one JSON object on its last line. Usage:
  python scripts/bench/lora_mixed.py --model models/demo [--rows 16] [--adapters 4] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def make_adapters(model_dir: str, count: int, rank: int, root: Path) -> list[Path]:
    """`count` random PEFT adapters of the model on every Linear layer (tests.lora_helpers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.lora_helpers import linear_shapes, make_adapter

    shapes = linear_shapes(Path(model_dir))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        make_adapter(root / f"a{i}", Path(model_dir), shapes=shapes, rank=rank, seed=i, targets=targets)
        for i in range(count)
    ]


def greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int, **kwargs: Any) -> tuple[float, torch.Tensor]:
    """Seconds of `new` greedy steps over the padded batch, and the tokens chosen [rows, new]."""
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return time.perf_counter() - t0, out[:, ids.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from core.engine.hf_lora import LoraBank, load_weights
    from core.lora import read_spec

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.model, args.adapters, args.rank, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(10, 4000, (args.rows, args.prompt), generator=gen)
        mask = torch.ones_like(ids)
        # Row r uses adapter r % (adapters + 1); the last of each cycle is the base model.
        choice = [r % (args.adapters + 1) for r in range(args.rows)]
        names = [f"a{c}" if c < args.adapters else "__base__" for c in choice]

        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), str(paths[0]), adapter_name="a0"
        )
        for i, path in enumerate(paths[1:], start=1):
            peft_model.load_adapter(str(path), adapter_name=f"a{i}")
        peft_model.eval()

        ours = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        bank = LoraBank(ours, args.adapters, args.rank)
        slots = []
        for i, path in enumerate(paths):
            spec = read_spec(f"a{i}", path, max_rank=args.rank, model_path=args.model, served_model="bench")
            slots.append(bank.assign(load_weights(spec, ours, args.rank, torch.float32), set()))
        row_slot = [slots[c] if c < args.adapters else -1 for c in choice]

        def group(module: Any, call_args: Any, kwargs: dict[str, Any]) -> None:
            x = kwargs.get("input_ids")
            rows, length = x.shape
            bank.set_step([row_slot[r] for r in range(rows) for _ in range(length)], x.device)

        ours.register_forward_pre_hook(group, with_kwargs=True)

        runs: dict[str, list[float]] = {"base": [], "peft": [], "slots": []}
        tokens: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for _ in range(args.repeat):
                for name in runs:
                    if name == "base":
                        s, t = greedy(base, ids, mask, args.new)
                    elif name == "peft":
                        s, t = greedy(peft_model, ids, mask, args.new, adapter_names=names)
                    else:
                        s, t = greedy(ours, ids, mask, args.new)
                    runs[name].append(s)
                    tokens[name] = t
        same = bool(torch.equal(tokens["peft"], tokens["slots"]))
        result = {name: round(args.rows * args.new / min(s), 1) for name, s in runs.items()}
        result.update(
            rows=args.rows,
            adapters=args.adapters,
            rank=args.rank,
            new_tokens=args.new,
            threads=args.threads,
            same_tokens=same,
        )
        print(f"tokens/s: base {result['base']}, peft {result['peft']}, slots {result['slots']}; same tokens: {same}")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
