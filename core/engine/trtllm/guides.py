"""Compiling a guide with the grammar library the TensorRT-LLM runtime uses, before it is sent.

The core checks every guide with llguidance (core.guided), but TensorRT-LLM compiles it with
XGrammar, and the two accept different things (XGrammar's regex converter refuses Unicode
classes such as `\\p{L}`, which llguidance takes; llguidance refuses JSON Schema keywords that
XGrammar ignores). The runtime compiles a guide late, inside the step that runs the whole
batch: the C++ executor in `GuidedDecoder::build` (`cpp/tensorrt_llm/batch_manager/
guidedDecoder.cpp`, called from `forwardAsync`), whose exception reaches
`terminateActiveRequests` and fails every active request; the PyTorch backend in its own
`GuidedDecoder` (`tensorrt_llm/_torch/pyexecutor/guided_decoder.py`). So one guide that
XGrammar cannot compile would take down every request in flight. `XGrammarCheck` compiles
each guide first, as the runtime will, and refuses it with INVALID_ARGUMENT naming its field.

The calls are `guidedDecoder.cpp`'s: JSON_SCHEMA -> `CompileJSONSchema(guide)` (any whitespace,
strict mode: the defaults of `xgrammar.Grammar.from_json_schema`), REGEX ->
`Grammar::FromRegex`, EBNF_GRAMMAR -> `Grammar::FromEBNF`. XGrammar is a dependency of
TensorRT-LLM itself (its `requirements.txt` pins the version the runtime is built with), so
it is present wherever the engines really run. Where it is not importable (a machine without
TensorRT-LLM, where the engines run over test doubles) the check logs that once and passes
every guide.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from typing import Any

from core.engine.trtllm.mapping import EXECUTOR_GUIDE_TYPES, guide_text
from core.errors import InvalidArgument
from core.types import Guide

log = logging.getLogger(__name__)

#: Compile results kept per engine (a repeated guide costs a dict lookup).
CACHE_SIZE = 512

# XGrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: ".
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def import_xgrammar() -> Any:
    """The `xgrammar` module, or None where it is not installed."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError:
        return None


class XGrammarCheck:
    """Compiles guides as TensorRT-LLM's XGrammar backend will (see the module docstring).

    Args:
        xgrammar: the `xgrammar` module (`import_xgrammar()`), or None: every guide passes.
    """

    def __init__(self, xgrammar: Any):
        self._xgr = xgrammar
        if xgrammar is None:
            log.warning(
                "xgrammar is not importable: guides are checked with llguidance only, so one that XGrammar "
                "cannot compile fails in the runtime, with every request of its batch"
            )
        self._error = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile_error)

    @property
    def active(self) -> bool:
        """Whether guides are compiled (xgrammar is importable)."""
        return self._xgr is not None

    def check(self, guide: Guide) -> None:
        """Compile `guide` as it is sent (mapping.EXECUTOR_GUIDE_TYPES, mapping.guide_text).

        Raises:
            InvalidArgument: XGrammar cannot compile it; the field is the guide's own
                ("guided_decoding.regex", ...).
        """
        if self._xgr is None:
            return
        error = self._error(EXECUTOR_GUIDE_TYPES[guide.kind], guide_text(guide))
        if error is not None:
            raise InvalidArgument(
                f"TensorRT-LLM's grammar backend (XGrammar) cannot compile this {guide.kind}: {error}",
                field=guide.field,
            )

    def _compile_error(self, guide_type: str, text: str) -> str | None:
        """XGrammar's error for one guide, or None when it compiles."""
        grammar = self._xgr.Grammar
        try:
            if guide_type == "JSON_SCHEMA":
                grammar.from_json_schema(text)
            elif guide_type == "REGEX":
                grammar.from_regex(text)
            elif guide_type == "EBNF_GRAMMAR":
                grammar.from_ebnf(text)
        except Exception as e:  # XGrammar raises RuntimeError, ValueError or its own types
            return _CPP_PREFIX.sub("", str(e).strip()) or type(e).__name__
        return None
