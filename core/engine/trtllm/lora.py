"""LoRA adapters on TensorRT-LLM: PEFT weights in the executor's per-request tensor layout,
and the task ids the executor's PEFT cache keys them by.

Layout (`tensorrt_llm.bindings.executor.LoraConfig(task_id, weights=None, config=None)`, every
release 0.11 to 1.3; rows built as `examples/hf_lora_convert.py` and
`tensorrt_llm/lora_manager.py` build them, checked as
`cpp/tensorrt_llm/runtime/loraUtils.cpp` `loraValidateRequestTensors` checks them):

  * `weights` `[num_module_layers, row]` in the model's dtype: per adapted module of one layer,
    `A` `[r, in]` flattened, then `scale * B` `[out, r]` flattened, zero-padded to the longest
    row;
  * `config` `[num_module_layers, 3]` int32: `[module_id, layer_idx, adapter_size]` (releases
    with DoRA accept a fourth `is_dora` column; three columns stay valid there).

Module ids: `LoraManager.LORA_MODULE_IDS` (tensorrt_llm/lora_manager.py) / `LoraModule::
ModuleType` (cpp/include/tensorrt_llm/runtime/loraModule.h). Hugging Face module names map as
`hf_modules_to_trtllm_modules` there (note that `gate_proj` is `mlp_h_to_4h` and `up_proj` is
`mlp_gate`).

The cache contract (cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp `addRequestPeft`):
a request with only a task id whose task is not in the cache fails with "LoRA task <id> not
found in cache. Please send LoRA weights with request"; a request carrying weights puts them
into the cache under its id. So weights go with the first request of a task, and again once
after such a miss (the cache evicts the least recently used tasks that no request uses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from core.engine.trtllm.engine_dir import EngineLayout
from core.errors import InvalidArgument
from core.lora import ADAPTER_WEIGHTS, AdapterSpec
from logclip import clip

#: `LoraManager.LORA_MODULE_IDS` (tensorrt_llm/lora_manager.py, 0.11 to 1.3).
MODULE_IDS: dict[str, int] = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
#: Hugging Face module name -> TensorRT-LLM LoRA module: `hf_modules_to_trtllm_modules` of
#: TensorRT-LLM's examples/hf_lora_convert.py (the converter this module's layout follows;
#: 0.11 to 1.2), less its MoE entries and `gate_up_proj` (a fused module whose B halves that
#: converter swaps). The same names as `get_default_trtllm_modules_to_hf_modules`
#: (tensorrt_llm/lora_manager.py) plus GPT's `c_fc` / `c_proj` (tensorrt_llm/models/gpt/model.py,
#: `GPTForCausalLM.trtllm_modules_to_hf_modules`). There is no `c_attn`: only QWen v1 maps it
#: (tensorrt_llm/models/qwen/model.py, qwen_type "qwen", whose `attn.c_proj` is attn_dense
#: where this table's `c_proj` is mlp_4h_to_h), and GPT's builds refuse it. The engine build
#: script (scripts/build_trtllm_engine.py) uses this table too.
HF_TO_TRTLLM: dict[str, str] = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "qkv_proj": "attn_qkv",
    "query_key_value": "attn_qkv",
    "o_proj": "attn_dense",
    "dense": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
    "c_fc": "mlp_h_to_4h",
    "c_proj": "mlp_4h_to_h",
}
#: The executor's error for a task id it does not hold (peftCacheManager.cpp).
CACHE_MISS = "not found in cache"
_KEY = re.compile(r".*\.layers\.([0-9]+)\..*?([A-Za-z_]+)\.lora_(A|B)\.weight$")


def is_cache_miss(message: str) -> bool:
    """Whether an executor error says the request's LoRA task is not in the PEFT cache."""
    return CACHE_MISS in message and "LoRA task" in message


@dataclass(frozen=True, eq=False)
class TrtAdapter:
    """A registered adapter in the executor's layout.

    Attributes:
        spec: the adapter.
        task_id: its LoRA task id (unique for the engine's lifetime, never reused).
        weights: torch tensor `[num_module_layers, row]` in the engine's dtype.
        config: torch int32 tensor `[num_module_layers, 3]`.
    """

    spec: AdapterSpec
    task_id: int
    weights: Any
    config: Any


def convert(spec: AdapterSpec, tensors: dict[str, Any], layout: EngineLayout) -> tuple[Any, Any]:
    """PEFT tensors (`adapter_model.safetensors`) as the executor's `(weights, config)`.

    Args:
        spec: the adapter (its scale multiplies B).
        tensors: key -> torch tensor, `...layers.<i>.<...>.<module>.lora_A.weight` [r, in] and
            `...lora_B.weight` [out, r].
        layout: the engine (its LoRA modules, layer count, max rank and dtype).

    Returns:
        weights `[n, row]` in the engine's dtype and config `[n, 3]` int32 (see the module
        docstring).

    Raises:
        InvalidArgument (reason LORA_BASE_MODEL_MISMATCH, field "path"): a module the engine
            was not built to adapt (`--lora_target_modules`), a layer beyond the engine's, an
            A without its B, or shapes that do not pair; LORA_RANK_TOO_LARGE: a rank above the
            engine's `--max_lora_rank`.
    """
    import torch

    where = f"The adapter at '{clip(spec.path)}'"
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _mismatch(f"{where} has a tensor '{clip(key)}' that is not a layer's lora_A or lora_B weight.")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = value
    rows: list[Any] = []
    config: list[list[int]] = []
    dtype = getattr(torch, layout.dtype, torch.float16)
    for (layer, module), ab in sorted(pairs.items()):
        trt = HF_TO_TRTLLM.get(module)
        if trt is None or trt not in layout.lora_modules:
            built = ", ".join(layout.lora_modules) or "none"
            raise _mismatch(
                f"{where} adapts '{module}', which this engine was not built to adapt (built for: {built})."
            )
        if layout.num_layers and layer >= layout.num_layers:
            raise _mismatch(f"{where} adapts layer {layer}; the engine has {layout.num_layers} layers.")
        if set(ab) != {"A", "B"}:
            raise _mismatch(f"{where} has lora_A without lora_B (or the reverse) for layer {layer} {module}.")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _mismatch(
                f"{where}: layer {layer} {module} has A {list(a.shape)} and B {list(b.shape)}, which do not pair."
            )
        rank = int(a.shape[0])
        if rank > layout.max_lora_rank:
            raise InvalidArgument(
                f"{where} has rank {rank}, above the engine's max_lora_rank {layout.max_lora_rank} "
                "(trtllm-build --max_lora_rank).",
                field="path",
                reason="LORA_RANK_TOO_LARGE",
            )
        rows.append(torch.cat([a.flatten(), (b.float() * spec.scale).flatten()]).to(dtype))
        config.append([MODULE_IDS[trt], layer, rank])
    if not rows:
        raise _mismatch(f"{where} has no LoRA weights.")
    width = max(int(r.shape[0]) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - int(r.shape[0]))) for r in rows])
    return weights, torch.tensor(config, dtype=torch.int32)


def read_adapter(spec: AdapterSpec, task_id: int, layout: EngineLayout) -> TrtAdapter:
    """Read `spec`'s weights file and convert it (see `convert`).

    Raises:
        InvalidArgument: as `convert`, or the file is not readable safetensors (field "path").
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(f"{spec.path}/{ADAPTER_WEIGHTS}")
    except (OSError, SafetensorError) as e:
        raise InvalidArgument(f"{clip(spec.path)}/{ADAPTER_WEIGHTS} is not readable: {e}", field="path") from None
    weights, config = convert(spec, tensors, layout)
    return TrtAdapter(spec, task_id, weights, config)


def _mismatch(message: str) -> InvalidArgument:
    return InvalidArgument(message, field="path", reason="LORA_BASE_MODEL_MISMATCH")
