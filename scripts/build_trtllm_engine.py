"""Build a TensorRT-LLM engine from a Hugging Face checkpoint, ready for `trellis-core --engine trtllm`.

Runs the model family's `convert_checkpoint.py` (or `quantization/quantize.py` for FP8 / INT4-AWQ)
from TensorRT-LLM's examples, then `trtllm-build`, and writes a serving manifest next to the
engine. Flags and their TensorRT-LLM counterparts: docs/tensorrt-llm.md, "Build an engine".
TensorRT-LLM releases up to 1.2.x (and 1.3.0rc20) have the engine build path; later ones do
not (see docs/tensorrt-llm.md).

Usage:
    python scripts/build_trtllm_engine.py --model <HF checkpoint dir> --output <dir> \\
        --trtllm-examples <TensorRT-LLM>/examples [--dtype float16] [--tp 1] [--pp 1] \\
        [--max-batch-size 32] [--max-input-len N] [--max-seq-len N] [--max-num-tokens N] \\
        [--paged-kv | --no-paged-kv] [--use-paged-context-fmha | --no-use-paged-context-fmha] \\
        [--quantization none|int8_wo|int4_wo|int8_kv|fp8|int4_awq] [--gather-context-logits] \\
        [--lora-dir <PEFT adapter dir> ...] [--lora-target-modules attn_q attn_v ...] \\
        [--max-lora-rank N] [--lora-plugin auto|float16|bfloat16|float32] [--dry-run]

LoRA (families in LORA_FAMILIES): any of the `--lora-*` flags builds the engine with
trtllm-build's `--lora_plugin`, `--lora_dir`, `--lora_ckpt_source hf`, `--lora_target_modules`
and `--max_lora_rank` (tensorrt_llm/commands/build.py; the first `--lora_dir` configures the
build). The modules default to those the adapters' adapter_config.json `target_modules` name,
mapped by the core's table (core.engine.trtllm.lora.HF_TO_TRTLLM); the rank to the
largest adapter `r` (or trtllm-build's 64). Adapters are sent per request at serving time
(`trellis-core --engine trtllm`, docs/lora.md), not compiled into the engine.

Output layout:
    <output>/engine/            config.json + rank{N}.engine (from trtllm-build)
    <output>/tokenizer/         the checkpoint's tokenizer files
    <output>/trellis-engine.json  the serving manifest (engine and tokenizer dirs, limits, build flags,
                                  TensorRT-LLM version, the exact commands)
Serve it with `trellis-core --engine trtllm --model <output>` (under `mpirun -n <tp*pp>` when
tp * pp > 1). Inputs are checked before anything runs; `--dry-run` prints the exact commands.
Exit status: 0 built (or dry run), 2 bad inputs, otherwise the failing step's status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the core's tables come from the checkout
    sys.path.insert(0, str(ROOT))

from core.engine.trtllm.lora import HF_TO_TRTLLM, MODULE_IDS  # noqa: E402

MANIFEST = "trellis-engine.json"  # core.engine.registry.ENGINE_MANIFEST

# Hugging Face model_type -> TensorRT-LLM examples directory (convert_checkpoint.py lives there).
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen",
    "qwen": "qwen",
    "gemma": "gemma",
    "gemma2": "gemma",
    "phi": "phi",
    "phi3": "phi",
    "gpt2": "gpt",
    "falcon": "falcon",
    "gptj": "gptj",
    "gpt_neox": "gptneox",
}
QUANTIZATIONS = ("none", "int8_wo", "int4_wo", "int8_kv", "fp8", "int4_awq")
# ModelOpt formats go through examples/quantization/quantize.py instead of convert_checkpoint.py.
MODELOPT = {"fp8": ["--qformat", "fp8", "--kv_cache_dtype", "fp8"], "int4_awq": ["--qformat", "int4_awq"]}
# Converters without --int8_kv_cache (read in each family's convert_checkpoint.py, old and new
# layouts; see tests/fakes/trtllm_converters.py for the files and commits).
NO_INT8_KV = {"phi", "falcon", "gptj", "gptneox"}
# Converters that take tensor parallelism only: gemma (--world-size, pp 1), phi (asserts pp_size == 1).
TP_ONLY = {"gemma", "phi"}
CONTRIB = {"falcon", "gptj", "gptneox"}  # examples/models/contrib/<family> from 0.18
# Families whose TensorRT-LLM model classes implement `use_lora` and whose examples document
# LoRA builds (examples/llama, examples/qwen, examples/gpt: "Run ... with LoRA").
LORA_FAMILIES = {"llama", "qwen", "gpt"}
# trtllm-build --lora_target_modules choices of the decoder modules (LoraManager.LORA_MODULE_IDS),
# and the Hugging Face names that map to them: the core's table, so that a build accepts exactly
# the adapters the core can then register.
LORA_MODULES = tuple(MODULE_IDS)
HF_LORA_MODULES = HF_TO_TRTLLM
LORA_PLUGIN_DTYPES = ("auto", "float16", "bfloat16", "float32")
TRTLLM_BUILD_MAX_LORA_RANK = 64  # trtllm-build --max_lora_rank default
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_COPY = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)


class InputError(Exception):
    """Inputs that make the build impossible; each line of the message is one problem."""


@dataclass
class Plan:
    """What will run: the commands in order, and what the manifest records."""

    model: Path
    output: Path
    family: str
    dtype: str
    checkpoint_dir: Path
    engine_dir: Path
    commands: list[list[str]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    flags: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    """The script's flags."""
    p = argparse.ArgumentParser(
        prog="build_trtllm_engine.py",
        description="Convert a Hugging Face checkpoint and build a TensorRT-LLM engine with a Trellis serving "
        "manifest.",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--output", required=True, help="output directory (engine/, tokenizer/, trellis-engine.json)")
    p.add_argument(
        "--trtllm-examples",
        default=os.environ.get("TRTLLM_EXAMPLES_DIR"),
        help="TensorRT-LLM's examples directory (a checkout matching the installed release) [env TRTLLM_EXAMPLES_DIR]",
    )
    p.add_argument(
        "--family",
        default="auto",
        help=f"model family ({', '.join(sorted(set(FAMILIES.values())))}; default: from config.json model_type)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="weights and activations (auto: the checkpoint's float16/bfloat16, else float16)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel GPUs")
    p.add_argument("--max-batch-size", type=int, default=32, help="largest running batch (sequences)")
    p.add_argument(
        "--max-input-len", type=int, default=None, help="longest prompt in tokens (default: min(1024, max-seq-len - 1))"
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="prompt + generated tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-tokens",
        type=int,
        default=None,
        help="tokens batched per step after padding removal (default: trtllm-build's)",
    )
    p.add_argument(
        "--paged-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="paged KV cache (needed for in-flight batching)",
    )
    p.add_argument(
        "--use-paged-context-fmha",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="paged context FMHA (needed for KV-cache block reuse and chunked context)",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=list(QUANTIZATIONS),
        help="int8_wo/int4_wo: weight-only; int8_kv: INT8 KV cache; fp8, int4_awq: ModelOpt",
    )
    p.add_argument(
        "--gather-context-logits",
        action="store_true",
        help="keep context logits (needed for prompt_logprobs; costs memory)",
    )
    p.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        help="a PEFT LoRA adapter directory (repeatable; trtllm-build --lora_dir; the first configures the build)",
    )
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        choices=list(LORA_MODULES),
        help="modules adapters may adapt (trtllm-build --lora_target_modules; default: the adapters')",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help=f"largest adapter rank served (default: the adapters' largest, else {TRTLLM_BUILD_MAX_LORA_RANK})",
    )
    p.add_argument(
        "--lora-plugin",
        default=None,
        choices=list(LORA_PLUGIN_DTYPES),
        help="build with the LoRA plugin in this dtype (implied, as auto, by the other --lora-* flags)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the conversion scripts")
    p.add_argument("--workers", type=int, default=1, help="parallel build workers (trtllm-build --workers)")
    p.add_argument(
        "--work-dir", default=None, help="where the converted checkpoint goes (default: <output>/checkpoint)"
    )
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the converted checkpoint")
    p.add_argument("--force", action="store_true", help="build into a non-empty output directory")
    p.add_argument("--dry-run", action="store_true", help="check inputs, print the exact commands, run nothing")
    return p


def _read_hf_config(model: Path, problems: list[str]) -> dict:
    if not model.is_dir():
        problems.append(f"--model {model}: no such directory")
        return {}
    config_file = model / "config.json"
    if not config_file.is_file():
        problems.append(f"--model {model}: no config.json (not a Hugging Face checkpoint)")
        return {}
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        problems.append(f"{config_file}: not valid JSON ({e})")
        return {}


def _find_convert_script(examples: Path, family: str) -> tuple[Path, str] | None:
    """The family's convert_checkpoint.py and its layout: "new" under models/{core,contrib}/
    (0.18 and later), "old" under examples/<family>/ (up to 0.17)."""
    for rel, layout in ((f"models/core/{family}", "new"), (f"models/contrib/{family}", "new"), (family, "old")):
        candidate = examples / rel / "convert_checkpoint.py"
        if candidate.is_file():
            return candidate, layout
    return None


def convert_command(
    python: str,
    script: Path,
    family: str,
    layout: str,
    *,
    model: Path,
    output: Path,
    dtype: str,
    tp: int,
    pp: int,
    quantization: str,
) -> list[str]:
    """The converter's command line, in the flags that family's script has in that layout.

    gemma's script names its flags differently (`--model-dir`, `--output-model-dir`,
    `--world-size`, `--ckpt-type hf`; weight-only precision is `--use-weight-only-with-precision`
    in the old layout, `--use_weight_only --weight_only_precision` in the new one) and has no
    pipeline parallelism. quantize.py (ModelOpt) takes the common flags and `--qformat`.
    """
    # The flags every converter but gemma's takes (quantize.py included).
    common = [python, str(script), "--model_dir", str(model), "--output_dir", str(output), "--dtype", dtype]
    common += ["--tp_size", str(tp), "--pp_size", str(pp)]
    if quantization in MODELOPT:
        return [*common, *MODELOPT[quantization]]
    precision = {"int8_wo": "int8", "int4_wo": "int4"}.get(quantization)
    if family == "gemma":
        cmd = [
            python,
            str(script),
            "--ckpt-type",
            "hf",
            "--model-dir",
            str(model),
            "--output-model-dir",
            str(output),
            "--dtype",
            dtype,
            "--world-size",
            str(tp),
        ]
        if precision:
            cmd += (
                ["--use-weight-only-with-precision", precision]
                if layout == "old"
                else ["--use_weight_only", "--weight_only_precision", precision]
            )
    else:
        cmd = common
        if precision:
            cmd += ["--use_weight_only", "--weight_only_precision", precision]
    if quantization == "int8_kv":
        cmd += ["--int8_kv_cache"]
    return cmd


def _kv_cache_flags(help_text: str | None, paged: bool) -> list[str]:
    """`--kv_cache_type` in recent trtllm-build, `--paged_kv_cache` (deprecated alias) before."""
    if help_text is not None and "--kv_cache_type" not in help_text:
        return ["--paged_kv_cache", "enable" if paged else "disable"]
    return ["--kv_cache_type", "paged" if paged else "continuous"]


def plan_build(args: argparse.Namespace, trtllm_build_help: str | None) -> Plan:
    """Check every input and work out the commands.

    Args:
        args: parsed flags.
        trtllm_build_help: `trtllm-build --help` output (None when trtllm-build is not
            available; the recent flag names are then assumed).

    Raises:
        InputError: listing every problem found (missing files, unsupported family,
            contradicting flags).
    """
    problems: list[str] = []
    warnings: list[str] = []
    model = Path(args.model).resolve()
    output = Path(args.output).resolve()
    hf = _read_hf_config(model, problems)
    if hf and model.is_dir():
        if not any(any(model.glob(p)) for p in WEIGHT_PATTERNS):
            problems.append(f"--model {model}: no weights (*.safetensors or pytorch_model*.bin)")
        if not any((model / f).is_file() for f in TOKENIZER_FILES):
            problems.append(f"--model {model}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")

    model_type = str(hf.get("model_type", "")) if hf else ""
    family = args.family
    if family == "auto":
        family = FAMILIES.get(model_type, "")
        if hf and not family:
            problems.append(
                f"model_type {model_type or '(none)'!r} is not a supported family; supported model types: "
                f"{', '.join(sorted(FAMILIES))} (or pass --family)"
            )
    elif family not in set(FAMILIES.values()):
        problems.append(f"--family {family}: unsupported; choose one of {', '.join(sorted(set(FAMILIES.values())))}")

    dtype = args.dtype
    if dtype == "auto":
        source = str(hf.get("torch_dtype") or hf.get("dtype") or "")
        dtype = source if source in ("float16", "bfloat16") else "float16"

    for name in ("tp", "pp", "max_batch_size", "workers"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    context = (hf.get("max_position_embeddings") or hf.get("n_positions")) if hf else None
    max_seq_len = args.max_seq_len or context
    if max_seq_len is None and hf:
        problems.append("--max-seq-len is required: config.json has no max_position_embeddings")
    if max_seq_len is not None and context and max_seq_len > context:
        warnings.append(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings {context}")
    max_input_len = args.max_input_len
    if max_input_len is None and max_seq_len:
        max_input_len = min(1024, max_seq_len - 1)
    if max_input_len is not None and max_seq_len is not None:
        if max_input_len < 1:
            problems.append("--max-input-len must be >= 1")
        if max_input_len >= max_seq_len:
            problems.append(
                f"--max-input-len {max_input_len} must be less than --max-seq-len {max_seq_len} "
                "(at least one token must be generated)"
            )
    if args.use_paged_context_fmha and not args.paged_kv:
        problems.append("--use-paged-context-fmha needs --paged-kv (paged context FMHA reads the paged KV cache)")
    if not args.paged_kv:
        warnings.append("--no-paged-kv: in-flight batching with the executor needs a paged KV cache")
    if not args.use_paged_context_fmha:
        warnings.append("--no-use-paged-context-fmha: the engine cannot reuse KV-cache blocks or chunk long prompts")
    if (
        args.max_num_tokens is not None
        and max_input_len is not None
        and args.max_num_tokens < max_input_len
        and not args.use_paged_context_fmha
    ):
        problems.append(
            f"--max-num-tokens {args.max_num_tokens} is below --max-input-len {max_input_len}: long prompts would "
            "need chunked context, which needs --use-paged-context-fmha"
        )
    if args.quantization != "none" and dtype == "float32":
        problems.append(f"--quantization {args.quantization} needs --dtype float16 or bfloat16")
    heads = hf.get("num_attention_heads") if hf else None
    if heads and args.tp >= 1 and heads % args.tp:
        problems.append(f"--tp {args.tp} must divide the model's {heads} attention heads")

    examples = Path(args.trtllm_examples).resolve() if args.trtllm_examples else None
    script = None
    layout = "new"
    if examples is None:
        problems.append("--trtllm-examples is required: TensorRT-LLM's examples directory (or TRTLLM_EXAMPLES_DIR)")
    elif not examples.is_dir():
        problems.append(f"--trtllm-examples {examples}: no such directory")
    elif args.quantization in MODELOPT:
        script = examples / "quantization" / "quantize.py"
        if not script.is_file():
            problems.append(f"{script}: not found (needed for --quantization {args.quantization})")
    elif family:
        found = _find_convert_script(examples, family)
        if found is None:
            problems.append(
                f"no convert_checkpoint.py for family {family!r} under {examples} "
                f"(looked in models/core/{family}, models/contrib/{family}, {family})"
            )
        else:
            script, layout = found
    if family in NO_INT8_KV and args.quantization == "int8_kv":
        problems.append(f"--quantization int8_kv: the {family} converter has no --int8_kv_cache")
    if family in TP_ONLY and args.pp > 1 and args.quantization not in MODELOPT:
        problems.append(f"--pp {args.pp}: the {family} converter supports tensor parallelism only (use --tp)")
    lora_flags = _lora_flags(args, family, problems)
    if not Path(args.python).exists() and shutil.which(args.python) is None:
        problems.append(f"--python {args.python}: not found")
    if output.exists() and any(output.iterdir()) and not args.force and not args.dry_run:
        problems.append(f"--output {output} is not empty (pass --force to build into it)")
    if problems:
        raise InputError("\n".join(problems))

    checkpoint = Path(args.work_dir).resolve() if args.work_dir else output / "checkpoint"
    engine = output / "engine"
    assert script is not None
    convert = convert_command(
        args.python,
        script,
        family,
        layout,
        model=model,
        output=checkpoint,
        dtype=dtype,
        tp=args.tp,
        pp=args.pp,
        quantization=args.quantization,
    )
    build = [
        "trtllm-build",
        "--checkpoint_dir",
        str(checkpoint),
        "--output_dir",
        str(engine),
        "--max_batch_size",
        str(args.max_batch_size),
        "--max_input_len",
        str(max_input_len),
        "--max_seq_len",
        str(max_seq_len),
        "--max_beam_width",
        "1",
    ]
    if args.max_num_tokens is not None:
        build += ["--max_num_tokens", str(args.max_num_tokens)]
    build += _kv_cache_flags(trtllm_build_help, args.paged_kv)
    build += ["--use_paged_context_fmha", "enable" if args.use_paged_context_fmha else "disable"]
    if args.quantization != "fp8":  # FP8 checkpoints pick their GEMM plugin themselves
        build += ["--gemm_plugin", dtype]
    build += ["--gpt_attention_plugin", dtype]
    if args.gather_context_logits:
        build += ["--gather_context_logits"]
    build += lora_flags
    if args.workers > 1:
        build += ["--workers", str(args.workers)]
    what = "Quantizing" if args.quantization in MODELOPT else "Converting"
    return Plan(
        model=model,
        output=output,
        family=family,
        dtype=dtype,
        checkpoint_dir=checkpoint,
        engine_dir=engine,
        commands=[convert, build],
        steps=[
            f"{what} the checkpoint ({family}, {dtype}, tp {args.tp} x pp {args.pp})",
            "Building the engine (trtllm-build)",
        ],
        flags={
            "dtype": dtype,
            "tp": args.tp,
            "pp": args.pp,
            "quantization": args.quantization,
            "paged_kv": args.paged_kv,
            "use_paged_context_fmha": args.use_paged_context_fmha,
            "gather_context_logits": args.gather_context_logits,
            "max_batch_size": args.max_batch_size,
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len,
            "max_num_tokens": args.max_num_tokens,
            "lora": lora_flags != [],
        },
        warnings=warnings,
    )


def _lora_flags(args: argparse.Namespace, family: str, problems: list[str]) -> list[str]:
    """trtllm-build's LoRA flags for the `--lora-*` arguments ([] when none is given); each
    problem found is appended to `problems` (a family without LoRA, an adapter directory
    without adapter_config.json or with modules the build cannot adapt, no modules at all, a
    rank below 1 or below an adapter's)."""
    wanted = args.lora_dir or args.lora_target_modules or args.max_lora_rank is not None or args.lora_plugin
    if not wanted:
        return []
    if family and family not in LORA_FAMILIES:
        problems.append(f"--lora-*: the {family} family has no LoRA support here ({', '.join(sorted(LORA_FAMILIES))})")
    modules: list[str] = []
    ranks: list[int] = []
    for raw in args.lora_dir:
        config_file = Path(raw) / "adapter_config.json"
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            problems.append(f"--lora-dir {raw}: no readable adapter_config.json ({e})")
            continue
        targets = config.get("target_modules") or []
        for target in [targets] if isinstance(targets, str) else targets:
            mapped = HF_LORA_MODULES.get(str(target))
            if mapped is None:
                problems.append(f"--lora-dir {raw}: module {target!r} has no TensorRT-LLM LoRA module")
            elif mapped not in modules:
                modules.append(mapped)
        if isinstance(config.get("r"), int):
            ranks.append(config["r"])
    targets = list(args.lora_target_modules or modules)
    if not targets:
        problems.append("--lora-*: no modules to adapt (give --lora-dir adapters or --lora-target-modules)")
    missing = [m for m in modules if m not in targets]
    if missing:
        problems.append(f"--lora-target-modules lacks {', '.join(missing)}, which the --lora-dir adapters adapt")
    rank = args.max_lora_rank if args.max_lora_rank is not None else max(ranks, default=TRTLLM_BUILD_MAX_LORA_RANK)
    if rank < 1 or (ranks and rank < max(ranks)):
        problems.append(f"--max-lora-rank {rank}: must be >= 1 and >= every adapter's rank ({max(ranks, default=1)})")
    flags = ["--lora_plugin", args.lora_plugin or "auto"]
    if args.lora_dir:
        flags += ["--lora_dir", *[str(Path(d).resolve()) for d in args.lora_dir], "--lora_ckpt_source", "hf"]
    return [*flags, "--lora_target_modules", *targets, "--max_lora_rank", str(rank)]


def _serve_command(plan: Plan) -> str:
    ranks = plan.flags["tp"] * plan.flags["pp"]
    core = f"trellis-core --engine trtllm --model {shlex.quote(str(plan.output))}"
    return f"mpirun -n {ranks} --allow-run-as-root {core}" if ranks > 1 else core


def write_manifest(plan: Plan) -> dict:
    """Copy the tokenizer next to the engine and write `trellis-engine.json`.

    Limits come from the engine's config.json `build_config` (what trtllm-build actually used),
    falling back to the requested values.
    """
    tokenizer_dir = plan.output / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_COPY:
        src = plan.model / name
        if src.is_file():
            shutil.copy2(src, tokenizer_dir / name)
    engine_config = json.loads((plan.engine_dir / "config.json").read_text())
    build = engine_config.get("build_config") or {}
    pretrained = engine_config.get("pretrained_config") or {}
    limits = {
        name: build.get(name, plan.flags.get(name))
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")
    }
    limits["max_beam_width"] = build.get("max_beam_width", 1)
    limits["vocab_size"] = pretrained.get("vocab_size")
    plugins = build.get("plugin_config") or {}
    manifest = {
        "format": 1,
        "engine_dir": "engine",
        "tokenizer_dir": "tokenizer",
        "source_model": str(plan.model),
        "model_family": plan.family,
        "tensorrt_llm_version": engine_config.get("version", "unknown"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "tp": plan.flags["tp"],
        "pp": plan.flags["pp"],
        "limits": limits,
        "use_paged_context_fmha": bool(plugins.get("use_paged_context_fmha", plan.flags["use_paged_context_fmha"])),
        "gather_context_logits": bool(build.get("gather_context_logits", plan.flags["gather_context_logits"])),
        "build_flags": plan.flags,
        "commands": plan.commands,
        "serve": _serve_command(plan),
    }
    (plan.output / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _check_engine(plan: Plan) -> None:
    ranks = plan.flags["tp"] * plan.flags["pp"]
    missing = [f"rank{r}.engine" for r in range(ranks) if not (plan.engine_dir / f"rank{r}.engine").is_file()]
    if not (plan.engine_dir / "config.json").is_file():
        missing.insert(0, "config.json")
    if missing:
        raise RuntimeError(f"trtllm-build finished but {plan.engine_dir} lacks {', '.join(missing)}")


def _trtllm_build_help() -> str | None:
    exe = shutil.which("trtllm-build")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    help_text = _trtllm_build_help()
    try:
        plan = plan_build(args, help_text)
    except InputError as e:
        print("build_trtllm_engine: cannot build:", file=sys.stderr)
        for line in str(e).splitlines():
            print(f"  - {line}", file=sys.stderr)
        return 2
    for w in plan.warnings:
        print(f"build_trtllm_engine: warning: {w}", file=sys.stderr)
    if args.dry_run:
        if help_text is None:
            print("# trtllm-build is not on PATH; assuming a recent release's flags", file=sys.stderr)
        for command in plan.commands:
            print(shlex.join(command))
        return 0
    if help_text is None:
        print(
            "build_trtllm_engine: cannot build:\n  - trtllm-build is not on PATH (install TensorRT-LLM <= 1.2.x, "
            "or 1.3.0rc20)",
            file=sys.stderr,
        )
        return 2
    total = len(plan.commands) + 1
    plan.output.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for step, (title, command) in enumerate(zip(plan.steps, plan.commands, strict=True), start=1):
        print(f"[{step}/{total}] {title}\n        $ {shlex.join(command)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(command, check=False).returncode
        if rc != 0:
            print(f"build_trtllm_engine: step {step}/{total} ({title}) failed with exit status {rc}", file=sys.stderr)
            return rc
        print(f"[{step}/{total}] done in {time.monotonic() - t0:.1f} s", flush=True)
    print(f"[{total}/{total}] Writing {MANIFEST} and copying the tokenizer", flush=True)
    try:
        _check_engine(plan)
        write_manifest(plan)
    except (RuntimeError, OSError, json.JSONDecodeError) as e:
        print(f"build_trtllm_engine: {e}", file=sys.stderr)
        return 1
    if not args.keep_checkpoint and not args.work_dir:
        shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
    print(f"Built {plan.engine_dir} in {time.monotonic() - started:.1f} s. Serve it with:\n    {_serve_command(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
