"""A TensorRT engine directory and the serving manifest next to it.

`trtllm-build` writes `config.json` (`pretrained_config`, `build_config`) and one
`rank{N}.engine` per GPU; scripts/build_trtllm_engine.py adds `trellis-engine.json` naming the
engine and tokenizer directories. This module reads the limits the adapter needs from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.engine.registry import ENGINE_MANIFEST


@dataclass(frozen=True)
class EngineLayout:
    """Where an engine lives and the limits it was built with (the engine's `config.json`
    `build_config`, as `trtllm-build` writes it, and our `trellis-engine.json`).

    Attributes:
        engine_dir: directory with config.json and rank{N}.engine.
        max_input_len: longest prompt the engine accepts.
        max_seq_len: prompt + generated tokens.
        max_batch_size, max_beam_width, max_num_tokens: build limits (max_num_tokens None = unknown).
        vocab_size: the model's vocabulary, unpadded (`pretrained_config.vocab_size`): the width
            of `embedding_bias`, which the decoder checks against `ModelConfig::getVocabSize()`
            (`cpp/tensorrt_llm/batch_manager/createNewDecoderRequests.cpp`, 1.x;
            `GptDecoderBatch::mVocabSize`, constructed from `getVocabSize()`, in 0.x).
        tp, pp: tensor and pipeline parallel sizes (one MPI rank each).
        paged_context_fmha: needed for KV-cache block reuse and chunked context.
        gather_context_logits: context logits can be returned (prompt logprobs).
        version: TensorRT-LLM version that built the engine, when recorded.
        tokens_per_block: tokens of one paged KV-cache block (`build_config.plugin_config.
            tokens_per_block`; None where the config does not record it): turns the reused
            blocks the runtime reports into reused tokens (reuse.reused_tokens).
        lora_modules: the TensorRT-LLM module names LoRA adapters may adapt
            (`build_config.lora_config.lora_target_modules`); empty when the engine was built
            without `--lora_plugin`, so it serves no adapters.
        max_lora_rank: the largest adapter rank the engine was built for (`--max_lora_rank`).
        num_layers: `pretrained_config.num_hidden_layers` (0 when unrecorded).
        dtype: `pretrained_config.dtype`, the dtype LoRA weights must have
            (`loraValidateRequestTensors`: "Expected lora weights to be the same data type as
            base model", cpp/tensorrt_llm/runtime/loraUtils.cpp).
    """

    engine_dir: Path
    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    max_beam_width: int
    max_num_tokens: int | None
    vocab_size: int
    tp: int = 1
    pp: int = 1
    paged_context_fmha: bool = False
    gather_context_logits: bool = False
    version: str | None = None
    tokens_per_block: int | None = None
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 0
    num_layers: int = 0
    dtype: str = "float16"

    @property
    def world_size(self) -> int:
        """MPI ranks the engine needs."""
        return self.tp * self.pp

    @property
    def vocab_size_padded(self) -> int:
        """Width of the engine's logits: the vocabulary padded to a multiple of the world
        size (`ModelConfig::getVocabSizePadded(worldConfig.getSize())`)."""
        return -(-self.vocab_size // self.world_size) * self.world_size


def read_engine_layout(model_dir: str | Path) -> EngineLayout:
    """Read an engine directory, or a build output holding `trellis-engine.json`.

    The manifest (written by scripts/build_trtllm_engine.py) names `engine_dir` relative to
    itself; the engine's own config.json (`pretrained_config`, `build_config`) is the source of
    limits, with the manifest's values as fallback.

    Raises:
        RuntimeError: no config.json, or the limits cannot be found.
    """
    root = Path(model_dir)
    manifest: dict[str, Any] = {}
    engine_dir = root
    manifest_file = root / ENGINE_MANIFEST
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        given = Path(manifest.get("engine_dir") or ".")
        engine_dir = given if given.is_absolute() else (root / given)
    config_file = engine_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    limits = manifest.get("limits") or {}
    if "build_config" not in config and not limits:
        raise RuntimeError(
            f"{engine_dir} is not a TensorRT-LLM engine directory (no config.json with a build_config); build one "
            "with scripts/build_trtllm_engine.py, or serve a Hugging Face checkpoint with --engine hf."
        )
    build = config.get("build_config") or {}
    pretrained = config.get("pretrained_config") or {}
    mapping = pretrained.get("mapping") or {}

    def pick(name: str, default: int | None = None) -> int:
        value = build.get(name, limits.get(name, default))
        if value is None:
            raise RuntimeError(f"{config_file}: build_config has no {name} (and {ENGINE_MANIFEST} does not say)")
        return int(value)

    tp = int(mapping.get("tp_size", manifest.get("tp", 1)))
    pp = int(mapping.get("pp_size", manifest.get("pp", 1)))
    vocab = int(pretrained.get("vocab_size") or limits.get("vocab_size") or 0)
    if vocab <= 0:
        raise RuntimeError(f"{config_file}: pretrained_config has no vocab_size")
    plugins = build.get("plugin_config") or {}
    max_num_tokens = build.get("max_num_tokens", limits.get("max_num_tokens"))
    lora = build.get("lora_config") or {}
    return EngineLayout(
        engine_dir=engine_dir,
        max_input_len=int(pick("max_input_len")),
        max_seq_len=int(pick("max_seq_len")),
        max_batch_size=int(pick("max_batch_size")),
        max_beam_width=int(pick("max_beam_width", 1)),
        max_num_tokens=int(max_num_tokens) if max_num_tokens else None,
        vocab_size=vocab,
        tp=tp,
        pp=pp,
        paged_context_fmha=bool(plugins.get("use_paged_context_fmha", manifest.get("use_paged_context_fmha", False))),
        gather_context_logits=bool(build.get("gather_context_logits", manifest.get("gather_context_logits", False))),
        version=config.get("version") or manifest.get("tensorrt_llm_version"),
        tokens_per_block=int(plugins["tokens_per_block"]) if plugins.get("tokens_per_block") else None,
        # trtllm-build --lora_plugin / --lora_target_modules / --max_lora_rank (build_config.lora_config)
        lora_modules=tuple(lora.get("lora_target_modules") or ()) if plugins.get("lora_plugin") else (),
        max_lora_rank=int(lora.get("max_lora_rank") or 0) if plugins.get("lora_plugin") else 0,
        num_layers=int(pretrained.get("num_hidden_layers") or 0),
        dtype=str(pretrained.get("dtype") or "float16"),
    )
