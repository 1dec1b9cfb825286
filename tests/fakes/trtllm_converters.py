"""The argparse flags of TensorRT-LLM's checkpoint converters, transcribed from upstream.

One parser per (family, layout): "old" is `examples/<family>/convert_checkpoint.py` (releases
up to 0.17), "new" is `examples/models/core/<family>/` or `examples/models/contrib/<family>/`
(0.18 and later). Each entry cites the NVIDIA/TensorRT-LLM file and the commit (release where
known) it was read at. Only the option strings, choices and `nargs` matter here: the test
parses the build script's generated commands with these parsers, so a flag a converter does
not have is an argparse error, as it is for real. `quantize.py` (ModelOpt) is included.
"""

from __future__ import annotations

import argparse
from typing import Any

DTYPES = ["float32", "bfloat16", "float16"]
DTYPES_AUTO = ["auto", "float16", "bfloat16", "float32"]

_TP_PP = [("--tp_size", {"type": int}), ("--pp_size", {"type": int})]
_WEIGHT_ONLY = [("--use_weight_only", {"action": "store_true"})]


def _wo(choices: list[str]) -> list[tuple[str, dict[str, Any]]]:
    return [*_WEIGHT_ONLY, ("--weight_only_precision", {"nargs": "?", "choices": choices})]


def _common(dtypes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("--model_dir", {}),
        ("--output_dir", {}),
        ("--dtype", {"choices": dtypes}),
        *_TP_PP,
        ("--workers", {"type": int}),
    ]


_GEMMA_OLD = [
    ("--ckpt-type", {"choices": ["jax", "keras", "torch", "hf"]}),
    ("--model-dir", {"required": True}),
    ("--output-model-dir", {"required": True}),
    ("--world-size", {"type": int}),
    ("--use-weight-only-with-precision", {"choices": ["int8", "int4", "w4a8_awq", "w4a16_awq"]}),
    ("--use-int8-weight-only-embedding", {"action": "store_true"}),
    ("--dtype", {"choices": DTYPES}),
    ("--enable_fp8", {"action": "store_true"}),
    ("--fp8_kv_cache", {"action": "store_true"}),
    ("--int8_kv_cache", {"action": "store_true"}),
    ("--load_model_on_cpu", {"action": "store_true"}),
]
_GEMMA_NEW = [
    ("--ckpt-type", {"choices": ["jax", "keras", "torch", "hf"]}),
    (("--model-dir", "--model_dir"), {"required": True}),
    (("--output-model-dir", "--output_dir"), {"required": True}),
    ("--world-size", {"type": int}),
    *_WEIGHT_ONLY,
    (
        ("--weight_only_precision", "--use-weight-only-with-precision"),
        {"choices": ["int8", "int4", "w4a8_awq", "w4a16_awq"]},
    ),
    ("--dtype", {"choices": DTYPES_AUTO}),
    ("--enable_fp8", {"action": "store_true"}),
    ("--fp8_kv_cache", {"action": "store_true"}),
    ("--int8_kv_cache", {"action": "store_true"}),
    ("--load_model_on_cpu", {"action": "store_true"}),
]

# (family, layout) -> (citation, flags)
CONVERTERS: dict[tuple[str, str], tuple[str, list[tuple[Any, dict[str, Any]]]]] = {
    ("llama", "old"): (
        "examples/llama/convert_checkpoint.py @04a2cacb (main, 0.12-era)",
        [
            *_common(DTYPES),
            *_wo(["int8", "int4", "int8_gptq", "int4_gptq", "int4_awq"]),
            ("--int8_kv_cache", {"action": "store_true"}),
            ("--fp8_kv_cache", {"action": "store_true"}),
        ],
    ),
    ("llama", "new"): (
        "examples/models/core/llama/convert_checkpoint.py @368f8f2a (2026 main)",
        [
            *_common(DTYPES_AUTO),
            *_wo(["int8", "int4", "int8_gptq", "int4_gptq", "int4_awq"]),
            ("--int8_kv_cache", {"action": "store_true"}),
            ("--fp8_kv_cache", {"action": "store_true"}),
        ],
    ),
    ("qwen", "old"): (
        "examples/qwen/convert_checkpoint.py @05316d33 (v0.11.0)",
        [*_common(DTYPES), *_wo(["int8", "int4", "int4_gptq"]), ("--int8_kv_cache", {"action": "store_true"})],
    ),
    ("qwen", "new"): (
        "examples/models/core/qwen/convert_checkpoint.py @0df9aaf3",
        [
            *_common(DTYPES_AUTO),
            *_wo(["int8", "int4", "int4_gptq", "int8_gptq"]),
            ("--int8_kv_cache", {"action": "store_true"}),
        ],
    ),
    ("gpt", "old"): (
        "examples/gpt/convert_checkpoint.py @1020a8d7 (main, 2024)",
        [*_common(DTYPES), *_wo(["int8", "int4"]), ("--int8_kv_cache", {"action": "store_true"})],
    ),
    ("gpt", "new"): (
        "examples/models/core/gpt/convert_checkpoint.py @7edbcccb (2026 main)",
        [*_common(DTYPES_AUTO), *_wo(["int8", "int4"]), ("--int8_kv_cache", {"action": "store_true"})],
    ),
    ("phi", "old"): (
        "examples/phi/convert_checkpoint.py @04a2cacb (asserts pp_size == 1; no --int8_kv_cache)",
        [*_common(DTYPES), *_wo(["int8", "int4"])],
    ),
    ("phi", "new"): (
        "examples/models/core/phi/convert_checkpoint.py @10c1d594 (asserts pp_size == 1; no --int8_kv_cache)",
        [*_common(DTYPES_AUTO), *_wo(["int8", "int4"])],
    ),
    ("falcon", "old"): (
        "examples/falcon/convert_checkpoint.py @06255cb7 (0.15.0.dev2024111200; no --int8_kv_cache)",
        [*_common(DTYPES_AUTO), *_wo(["int8", "int4"])],
    ),
    ("falcon", "new"): (
        "examples/models/contrib/falcon/convert_checkpoint.py @323e8460 (no --int8_kv_cache)",
        [*_common(DTYPES_AUTO), *_wo(["int8", "int4"])],
    ),
    ("gptj", "old"): (
        "examples/gptj/convert_checkpoint.py @250d9c29 (v0.9.0; no --int8_kv_cache)",
        [*_common(DTYPES), *_wo(["int8", "int4"])],
    ),
    ("gptj", "new"): (
        "examples/models/contrib/gptj/convert_checkpoint.py @25b6cdd8 (no --int8_kv_cache)",
        [*_common(DTYPES_AUTO), *_wo(["int8", "int4"])],
    ),
    ("gptneox", "old"): (
        "examples/gptneox/convert_checkpoint.py @0ab9d17a (no --int8_kv_cache)",
        [*_common(DTYPES), *_wo(["int8", "int4", "int4_gptq"])],
    ),
    ("gptneox", "new"): (
        "examples/models/contrib/gptneox/convert_checkpoint.py @2a9abd95 (no --int8_kv_cache)",
        [*_common(DTYPES), *_wo(["int8", "int4", "int4_gptq"])],
    ),
    ("gemma", "old"): (
        "examples/gemma/convert_checkpoint.py @201135e5 (v0.13.0; tensor parallelism only)",
        _GEMMA_OLD,
    ),
    ("gemma", "new"): (
        "examples/models/core/gemma/convert_checkpoint.py @310decb9 (tensor parallelism only)",
        _GEMMA_NEW,
    ),
    ("quantize", "any"): (
        "examples/quantization/quantize.py @059c97c1",
        [
            ("--model_dir", {}),
            ("--output_dir", {}),
            ("--dtype", {"choices": DTYPES_AUTO}),
            (
                "--qformat",
                {"choices": ["nvfp4", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "full_prec"]},
            ),
            ("--kv_cache_dtype", {"choices": ["int8", "fp8", None]}),
            *_TP_PP,
        ],
    ),
}


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit(2)
        raise _Refused(message)


def parse(family: str, layout: str, argv: list[str]) -> argparse.Namespace:
    """Parse a converter's argv as the real script would.

    Raises:
        ValueError: the script would exit with an argparse error (the message says why).
    """
    _, flags = CONVERTERS[(family, layout)]
    parser = _Parser(prog=family)
    for names, kwargs in flags:
        parser.add_argument(*((names,) if isinstance(names, str) else names), **kwargs)
    try:
        return parser.parse_args(argv)
    except _Refused as e:
        raise ValueError(str(e)) from None
