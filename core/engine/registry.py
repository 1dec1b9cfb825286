"""Engine kinds by name, imported lazily.

`import core` and the HF engine never import TensorRT-LLM; `--engine trtllm` without it fails
at start with a message naming the `trtllm` extra.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from core.config import CoreConfig
    from core.engine.base import Engine
    from core.tokenizer import Tokenizer

#: An engine module's factory: `build(config: CoreConfig, tokenizer: Tokenizer) -> Engine`.
EngineFactory: TypeAlias = "Callable[[CoreConfig, Tokenizer], Engine]"

# name -> "module:factory" (an EngineFactory).
ENGINES = {
    "hf": "core.engine.hf_process:build",
    "mock": "core.engine.mock:build",
    "trtllm": "core.engine.trtllm.executor:build",
    "trtllm-llm": "core.engine.trtllm.llm:build",
}


def create_engine(config: CoreConfig, tokenizer: Tokenizer) -> Engine:
    """Build (but not start) the engine named by `config.engine`.

    Raises:
        ValueError: unknown engine name.
        RuntimeError: the engine's dependencies are missing (the message says what to install).
    """
    target = ENGINES.get(config.engine)
    if target is None:
        raise ValueError(f"unknown engine {config.engine!r}; choose one of {', '.join(ENGINES)}")
    module_name, _, factory = target.partition(":")
    build: EngineFactory = getattr(importlib.import_module(module_name), factory)
    return build(config, tokenizer)


# Written by scripts/build_trtllm_engine.py into an engine directory; names the tokenizer.
ENGINE_MANIFEST = "trellis-engine.json"


def tokenizer_path(config: CoreConfig) -> str:
    """Where the tokenizer lives: --tokenizer, else the engine manifest's tokenizer_dir (relative
    to the manifest), else --model."""
    if config.tokenizer:
        return config.tokenizer
    manifest = Path(config.model) / ENGINE_MANIFEST
    if manifest.is_file():
        tok_dir = json.loads(manifest.read_text()).get("tokenizer_dir")
        if tok_dir:
            return str((manifest.parent / tok_dir).resolve())
    return config.model
