"""core.engine.trtllm.lora: PEFT tensors in the executor's LoraConfig layout, and every refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.engine.trtllm.engine_dir import EngineLayout
from core.engine.trtllm.lora import MODULE_IDS, convert, is_cache_miss, read_adapter
from core.errors import InvalidArgument
from core.lora import AdapterSpec

LAYOUT = EngineLayout(
    engine_dir=Path("."),
    max_input_len=8,
    max_seq_len=16,
    max_batch_size=1,
    max_beam_width=1,
    max_num_tokens=None,
    vocab_size=32,
    lora_modules=("attn_q", "mlp_4h_to_h"),
    max_lora_rank=4,
    num_layers=2,
    dtype="float16",
)
SPEC = AdapterSpec("a", "/adapters/a", rank=2, scale=2.0, target_modules=("q_proj",))


def key(layer: int, module: str, which: str) -> str:
    part = "self_attn" if module == "q_proj" else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{which}.weight"


def test_rows_are_a_then_scaled_b_padded_and_config_names_module_layer_rank():
    a0, b0 = torch.ones(2, 8), torch.full((8, 2), 0.5)
    a1, b1 = torch.ones(2, 16), torch.ones(8, 2)
    tensors = {
        key(0, "q_proj", "A"): a0,
        key(0, "q_proj", "B"): b0,
        key(1, "down_proj", "A"): a1,
        key(1, "down_proj", "B"): b1,
    }
    weights, config = convert(SPEC, tensors, LAYOUT)
    assert weights.dtype == torch.float16 and tuple(weights.shape) == (2, 2 * (16 + 8))
    assert config.dtype == torch.int32
    assert config.tolist() == [[MODULE_IDS["attn_q"], 0, 2], [MODULE_IDS["mlp_4h_to_h"], 1, 2]]
    row = weights[0].float()
    assert torch.equal(row[:16], a0.flatten()) and torch.equal(row[16:32], (b0 * 2.0).flatten())
    assert torch.count_nonzero(row[32:]) == 0  # padded to the longest row


@pytest.mark.parametrize(
    "tensors, reason, words",
    [
        ({"lm_head.weight": torch.ones(2, 2)}, "LORA_BASE_MODEL_MISMATCH", "not a layer's lora_A or lora_B"),
        (
            {key(0, "k_proj", "A"): torch.ones(2, 8), key(0, "k_proj", "B"): torch.ones(8, 2)},
            "LORA_BASE_MODEL_MISMATCH",
            "'k_proj'",
        ),
        (
            {key(5, "q_proj", "A"): torch.ones(2, 8), key(5, "q_proj", "B"): torch.ones(8, 2)},
            "LORA_BASE_MODEL_MISMATCH",
            "layer 5",
        ),
        ({key(0, "q_proj", "A"): torch.ones(2, 8)}, "LORA_BASE_MODEL_MISMATCH", "lora_A without lora_B"),
        (
            {key(0, "q_proj", "A"): torch.ones(2, 8), key(0, "q_proj", "B"): torch.ones(8, 3)},
            "LORA_BASE_MODEL_MISMATCH",
            "do not pair",
        ),
        (
            {key(0, "q_proj", "A"): torch.ones(8, 8), key(0, "q_proj", "B"): torch.ones(8, 8)},
            "LORA_RANK_TOO_LARGE",
            "max_lora_rank 4",
        ),
        ({}, "LORA_BASE_MODEL_MISMATCH", "no LoRA weights"),
    ],
)
def test_refusals(tensors, reason, words):
    with pytest.raises(InvalidArgument) as e:
        convert(SPEC, tensors, LAYOUT)
    assert e.value.reason == reason and words in e.value.message and e.value.field == "path"


def test_an_unreadable_weights_file_is_invalid(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    spec = AdapterSpec("a", str(tmp_path), rank=2, scale=1.0, target_modules=("q_proj",))
    with pytest.raises(InvalidArgument, match="is not readable"):
        read_adapter(spec, 1, LAYOUT)


def test_cache_miss_is_the_executors_wording():
    assert is_cache_miss("LoRA task 3 not found in cache. Please send LoRA weights with request")
    assert not is_cache_miss("Encountered an error when fetching new request: Prompt length (9) exceeds")
