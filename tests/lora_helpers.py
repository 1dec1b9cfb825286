"""LoRA adapters for tests: random PEFT-format adapters of a model, and the greedy tokens of the
model with one merged into its weights by peft (`merge_and_unload`), the exactness reference."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module path -> (in_features, out_features) of every Linear layer of the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def make_adapter(
    out: Path,
    model_dir: Path,
    *,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    magnitude: float = 0.5,
    config: dict[str, Any] | None = None,
    shapes: dict[str, tuple[int, int]] | None = None,
) -> Path:
    """Write a random LoRA adapter for `model_dir` to `out` in peft's layout (keys
    base_model.model.<module>.lora_{A,B}.weight) and return `out`. `config` overrides entries
    of adapter_config.json; `shapes` overrides the model's Linear shapes (to make misfits)."""
    from safetensors.torch import save_file

    shapes = shapes or linear_shapes(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for path, (fan_in, fan_out) in shapes.items():
        if path.rsplit(".", 1)[-1] not in targets:
            continue
        a = torch.randn((rank, fan_in), generator=gen) / fan_in**0.5
        b = torch.randn((fan_out, rank), generator=gen) * magnitude / rank**0.5
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "base_model_name_or_path": str(model_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def merged_greedy(
    model_dir: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], steps: int
) -> list[list[int]]:
    """Greedy continuations (`steps` tokens, EOS ignored) of each prompt by the model with
    `adapter` merged into its weights by peft's merge_and_unload (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt) :])
    return outs
