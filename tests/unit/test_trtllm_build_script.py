"""scripts/build_trtllm_engine.py: input checks, `--dry-run` commands, and a full build with a
fake `trtllm-build` on PATH and a fake TensorRT-LLM examples directory (each fake records its
argv and writes the files the real tool would: an engine directory's `config.json` and
`rank{N}.engine` files)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from core.config import CoreConfig
from core.engine.registry import tokenizer_path
from core.engine.trtllm import executor as trtllm
from core.tokenizer import Tokenizer
from core.types import EngineRequest, SamplingOptions
from tests.fakes import trtllm_converters, trtllm_executor

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("build_trtllm_engine", ROOT / "scripts" / "build_trtllm_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


script = _load()

FAKE_BUILD = """#!{python}
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["FAKE_TRTLLM_LOG"], "a") as f:
    f.write(json.dumps(["trtllm-build"] + argv) + "\\n")
if argv == ["--help"]:
    print("usage: trtllm-build --checkpoint_dir ... " + ("--paged_kv_cache" if os.environ.get("FAKE_TRTLLM_OLD")
                                                       else "--kv_cache_type {{continuous,paged,disabled}}"))
    sys.exit(0)
rc = int(os.environ.get("FAKE_TRTLLM_BUILD_RC", "0"))
if rc:
    print("trtllm-build: simulated failure", file=sys.stderr)
    sys.exit(rc)
args = dict(zip(argv[::2], argv[1::2]))
ckpt = json.loads((Path(args["--checkpoint_dir"]) / "config.json").read_text())
out = Path(args["--output_dir"])
out.mkdir(parents=True, exist_ok=True)
build = {{k: int(args["--" + k]) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_beam_width")}}
build["max_num_tokens"] = int(args.get("--max_num_tokens", 8192))
build["gather_context_logits"] = "--gather_context_logits" in argv
build["plugin_config"] = {{"use_paged_context_fmha": args.get("--use_paged_context_fmha") == "enable"}}
(out / "config.json").write_text(json.dumps({{"version": "1.2.0", "pretrained_config": ckpt, "build_config": build}}))
mapping = ckpt["mapping"]
ranks = 0 if os.environ.get("FAKE_TRTLLM_NO_ENGINE") else mapping["tp_size"] * mapping["pp_size"]
for rank in range(ranks):
    (out / f"rank{{rank}}.engine").write_bytes(b"engine")
print("[TensorRT-LLM] Engine built")
"""

FAKE_CONVERT = """#!{python}
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["FAKE_TRTLLM_LOG"], "a") as f:
    f.write(json.dumps([Path(sys.argv[0]).name] + argv) + "\\n")
rc = int(os.environ.get("FAKE_CONVERT_RC", "0"))
if rc:
    sys.exit(rc)
args = dict(zip(argv[::2], argv[1::2]))
hf = json.loads((Path(args["--model_dir"]) / "config.json").read_text())
out = Path(args["--output_dir"])
out.mkdir(parents=True, exist_ok=True)
tp, pp = int(args["--tp_size"]), int(args["--pp_size"])
config = {{"architecture": hf["architectures"][0], "dtype": args["--dtype"], "vocab_size": hf["vocab_size"],
          "mapping": {{"world_size": tp * pp, "tp_size": tp, "pp_size": pp}}}}
(out / "config.json").write_text(json.dumps(config))
for rank in range(tp * pp):
    (out / f"rank{{rank}}.safetensors").write_bytes(b"weights")
"""


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """Fake trtllm-build first on PATH and a fake examples dir; returns (examples dir, log reader)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    build = bin_dir / "trtllm-build"
    build.write_text(FAKE_BUILD.format(python=sys.executable))
    build.chmod(0o755)
    examples = tmp_path / "examples"
    for rel in ("models/core/llama/convert_checkpoint.py", "quantization/quantize.py"):
        f = examples / rel
        f.parent.mkdir(parents=True)
        f.write_text(FAKE_CONVERT.format(python=sys.executable))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return examples, calls


@pytest.fixture
def hf_dir(tmp_path, tiny_model_dir):
    """A checkpoint directory like the tiny model (config, tokenizer, placeholder weights)."""
    d = tmp_path / "hf"
    d.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (tiny_model_dir / name).exists():
            shutil.copy2(tiny_model_dir / name, d / name)
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def args(hf_dir, out, examples, *extra):
    return [
        "--model",
        str(hf_dir),
        "--output",
        str(out),
        "--trtllm-examples",
        str(examples),
        "--max-input-len",
        "256",
        "--max-seq-len",
        "512",
        *extra,
    ]


def test_dry_run_prints_the_exact_commands(tools, hf_dir, tmp_path, capsys):
    examples, calls = tools
    out = tmp_path / "out"
    assert script.main(args(hf_dir, out, examples, "--max-num-tokens", "1024", "--dry-run")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{sys.executable} {examples}/models/core/llama/convert_checkpoint.py --model_dir {hf_dir} "
        f"--output_dir {out}/checkpoint --dtype float16 --tp_size 1 --pp_size 1",
        f"trtllm-build --checkpoint_dir {out}/checkpoint --output_dir {out}/engine --max_batch_size 32 "
        "--max_input_len 256 --max_seq_len 512 --max_beam_width 1 --max_num_tokens 1024 --kv_cache_type paged "
        "--use_paged_context_fmha enable --gemm_plugin float16 --gpt_attention_plugin float16",
    ]
    assert not out.exists()
    assert [c[0] for c in calls()] == ["trtllm-build"]  # only `--help`, to pick the flag names


@pytest.mark.parametrize(
    "extra, env, expected",
    [
        (
            ["--quantization", "int8_wo", "--dtype", "bfloat16"],
            {},
            ["--dtype bfloat16", "--use_weight_only --weight_only_precision int8", "--gemm_plugin bfloat16"],
        ),
        (["--quantization", "fp8"], {}, ["quantization/quantize.py", "--qformat fp8 --kv_cache_dtype fp8"]),
        (
            ["--quantization", "int8_kv", "--tp", "2", "--workers", "2"],
            {},
            ["--tp_size 2", "--int8_kv_cache", "--workers 2"],
        ),
        (
            ["--no-use-paged-context-fmha", "--gather-context-logits"],
            {},
            ["--use_paged_context_fmha disable", "--gather_context_logits"],
        ),
        ([], {"FAKE_TRTLLM_OLD": "1"}, ["--paged_kv_cache enable"]),
        (["--no-paged-kv", "--no-use-paged-context-fmha"], {}, ["--kv_cache_type continuous"]),
    ],
)
def test_dry_run_flags(tools, hf_dir, tmp_path, capsys, monkeypatch, extra, env, expected):
    examples, _ = tools
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert script.main(args(hf_dir, tmp_path / "out", examples, *extra, "--dry-run")) == 0
    printed = capsys.readouterr().out
    for fragment in expected:
        assert fragment in printed


def test_dry_run_without_trtllm_build_assumes_recent_flags(tmp_path, hf_dir, capsys, monkeypatch, tools):
    examples, _ = tools
    monkeypatch.setenv("PATH", "/nonexistent")
    assert script.main(args(hf_dir, tmp_path / "out", examples, "--dry-run")) == 0
    captured = capsys.readouterr()
    assert "--kv_cache_type paged" in captured.out and "not on PATH" in captured.err
    assert script.main(args(hf_dir, tmp_path / "out", examples)) == 2
    assert "trtllm-build is not on PATH" in capsys.readouterr().err


def _edit_config(hf_dir, **changes):
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "prepare, extra, message",
    [
        (lambda d: shutil.rmtree(d), [], "no such directory"),
        (lambda d: (d / "config.json").unlink(), [], "no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), [], "no weights"),
        (lambda d: (d / "tokenizer.json").unlink(), [], "no tokenizer files"),
        (lambda d: _edit_config(d, model_type="mamba"), [], "'mamba' is not a supported family"),
        (None, ["--family", "bert"], "--family bert: unsupported"),
        (None, ["--max-input-len", "512"], "must be less than --max-seq-len 512"),
        (None, ["--no-paged-kv"], "--use-paged-context-fmha needs --paged-kv"),
        (None, ["--no-use-paged-context-fmha", "--max-num-tokens", "100"], "need chunked context"),
        (None, ["--quantization", "fp8", "--dtype", "float32"], "needs --dtype float16 or bfloat16"),
        (None, ["--tp", "3"], "--tp 3 must divide the model's 4 attention heads"),
        (None, ["--tp", "0"], "--tp must be >= 1"),
        (None, ["--trtllm-examples", "/nonexistent/examples"], "no such directory"),
        (lambda d: _edit_config(d, model_type="qwen2"), [], "no convert_checkpoint.py for family 'qwen'"),
    ],
)
def test_inputs_are_checked_before_anything_runs(tools, hf_dir, tmp_path, capsys, prepare, extra, message):
    examples, calls = tools
    if prepare is not None:
        prepare(hf_dir)
    assert script.main(args(hf_dir, tmp_path / "out", examples, *extra)) == 2
    assert message in capsys.readouterr().err
    assert [c for c in calls() if c[1:] != ["--help"]] == []


def test_non_empty_output_needs_force(tools, hf_dir, tmp_path, capsys):
    examples, _ = tools
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    assert script.main(args(hf_dir, out, examples)) == 2
    assert "is not empty" in capsys.readouterr().err


def test_failed_step_stops_the_build(tools, hf_dir, tmp_path, capsys, monkeypatch):
    examples, calls = tools
    monkeypatch.setenv("FAKE_CONVERT_RC", "3")
    assert script.main(args(hf_dir, tmp_path / "out", examples)) == 3
    assert "step 1/3" in capsys.readouterr().err
    assert not any(c[0] == "trtllm-build" and "--checkpoint_dir" in c for c in calls())


async def test_full_build_writes_a_manifest_the_engine_serves(tools, hf_dir, tmp_path, capsys, monkeypatch):
    examples, calls = tools
    out = tmp_path / "out"
    assert script.main(args(hf_dir, out, examples, "--max-batch-size", "4", "--max-num-tokens", "1024")) == 0
    printed = capsys.readouterr().out
    assert "[1/3] Converting the checkpoint (llama, float16, tp 1 x pp 1)" in printed
    assert "[2/3] Building the engine" in printed and "[3/3] Writing trellis-engine.json" in printed
    ran = [c for c in calls() if c[1:] != ["--help"]]
    assert [c[0] for c in ran] == ["convert_checkpoint.py", "trtllm-build"]
    manifest = json.loads((out / "trellis-engine.json").read_text())
    assert manifest["engine_dir"] == "engine" and manifest["tokenizer_dir"] == "tokenizer"
    assert manifest["tensorrt_llm_version"] == "1.2.0"
    assert manifest["limits"] == {
        "max_batch_size": 4,
        "max_input_len": 256,
        "max_seq_len": 512,
        "max_num_tokens": 1024,
        "max_beam_width": 1,
        "vocab_size": 4096,
    }
    assert manifest["use_paged_context_fmha"] is True and manifest["build_flags"]["quantization"] == "none"
    assert manifest["commands"][1][0] == "trtllm-build" and manifest["serve"].startswith("trellis-core --engine trtllm")
    assert (out / "tokenizer" / "tokenizer.json").is_file() and not (out / "checkpoint").exists()

    # The output is what `trellis-core --engine trtllm --model <out>` reads.
    config = CoreConfig(model=str(out), engine="trtllm", max_queue_size=8)
    assert tokenizer_path(config) == str(out / "tokenizer")
    tokenizer = Tokenizer.load(tokenizer_path(config))
    trtllm_executor.install(monkeypatch, "1.0")
    engine = trtllm.build(config, tokenizer)
    assert engine.layout.engine_dir == out / "engine" and engine.info.max_context_length == 512
    await engine.start()
    try:
        req = EngineRequest("m1", tokenizer.encode("hi"), engine.resolve_sampling(SamplingOptions(), random_seed=1), 3)
        outs = [o async for o in engine.generate(req)]
        assert outs[-1].finished and sum(len(s.token_ids) for o in outs for s in o.sequences) == 3
    finally:
        await engine.shutdown()


def test_tensor_parallel_build_is_served_under_mpirun(tools, hf_dir, tmp_path, capsys):
    examples, _ = tools
    out = tmp_path / "out"
    assert script.main(args(hf_dir, out, examples, "--tp", "2", "--keep-checkpoint")) == 0
    assert {p.name for p in (out / "engine").iterdir()} == {"config.json", "rank0.engine", "rank1.engine"}
    manifest = json.loads((out / "trellis-engine.json").read_text())
    assert manifest["tp"] == 2 and manifest["serve"].startswith("mpirun -n 2 ")
    assert (out / "checkpoint" / "rank1.safetensors").is_file()
    assert "mpirun -n 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "env, status, message",
    [
        ({"FAKE_TRTLLM_BUILD_RC": "4"}, 4, "step 2/3 (Building the engine (trtllm-build)) failed with exit status 4"),
        ({"FAKE_TRTLLM_NO_ENGINE": "1"}, 1, "lacks rank0.engine"),
    ],
)
def test_build_failures_are_reported(tools, hf_dir, tmp_path, capsys, monkeypatch, env, status, message):
    examples, _ = tools
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    assert script.main(args(hf_dir, out, examples)) == status
    assert message in capsys.readouterr().err
    assert not (out / "trellis-engine.json").exists()


def test_defaults_come_from_the_checkpoint(tools, hf_dir, tmp_path, capsys):
    examples, _ = tools
    base = ["--model", str(hf_dir), "--output", str(tmp_path / "out"), "--trtllm-examples", str(examples)]
    assert script.main([*base, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "--max_input_len 1023 --max_seq_len 1024" in printed  # max_position_embeddings 1024
    _edit_config(hf_dir, max_position_embeddings=None)
    assert script.main([*base, "--dry-run"]) == 2
    assert "--max-seq-len is required" in capsys.readouterr().err
    assert script.main([*base, "--max-seq-len", "64", "--python", "/nonexistent/python", "--dry-run"]) == 2
    assert "--python /nonexistent/python: not found" in capsys.readouterr().err


# ------------------------------------------------------------------------- converter flags


FAMILY_OF = {
    "llama": "llama",
    "qwen": "qwen2",
    "gemma": "gemma",
    "phi": "phi3",
    "gpt": "gpt2",
    "falcon": "falcon",
    "gptj": "gptj",
    "gptneox": "gpt_neox",
}


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("family", sorted(FAMILY_OF))
@pytest.mark.parametrize("quantization", ["none", "int8_wo", "int4_wo", "int8_kv", "fp8"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_generated_commands_parse_with_the_converters_real_flags(
    tmp_path, hf_dir, family, layout, quantization, tp, pp, capsys
):
    """Every command the script prints parses with the converter's argparse flags as
    transcribed from upstream (tests/fakes/trtllm_converters.py cites file and commit), or the
    script refuses the combination before running anything (exit 2)."""
    examples = tmp_path / "examples"
    rel = {"old": family, "new": f"models/{'contrib' if family in script.CONTRIB else 'core'}/{family}"}[layout]
    for path in (examples / rel / "convert_checkpoint.py", examples / "quantization" / "quantize.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    _edit_config(hf_dir, model_type=FAMILY_OF[family], num_attention_heads=4)
    flags = ["--quantization", quantization, "--tp", str(tp), "--pp", str(pp), "--dry-run"]
    rc = script.main(args(hf_dir, tmp_path / "out", examples, *flags))
    out, err = capsys.readouterr()
    if rc == 2:  # refused up front: only combinations the converter cannot run
        assert (quantization == "int8_kv" and family in script.NO_INT8_KV) or (
            pp > 1 and family in script.TP_ONLY and quantization != "fp8"
        ), err
        return
    assert rc == 0, err
    argv = shlex.split(out.splitlines()[0])[2:]
    which = ("quantize", "any") if quantization == "fp8" else (family, layout)
    ns = trtllm_converters.parse(*which, argv)  # raises on a flag the converter does not have
    if which[0] == "gemma":
        assert ns.ckpt_type == "hf" and ns.world_size == tp
    elif which[0] != "quantize":
        assert (ns.tp_size, ns.pp_size) == (tp, pp)


@pytest.mark.parametrize(
    "family, layout, argv",
    [
        ("gemma", "old", ["--model_dir", "m", "--output_dir", "o", "--tp_size", "1"]),  # the 0.x script
        ("gptj", "old", ["--model_dir", "m", "--int8_kv_cache"]),
        ("gptneox", "new", ["--model_dir", "m", "--int8_kv_cache"]),
        ("gptneox", "new", ["--model_dir", "m", "--dtype", "auto"]),
    ],
)
def test_the_transcribed_flags_refuse_what_upstream_refuses(family, layout, argv):
    """Commands the script printed before the fix, as the real converters answer them."""
    with pytest.raises(ValueError):
        trtllm_converters.parse(family, layout, argv)


def _peft_dir(path: Path, targets=("q_proj", "v_proj"), rank=8) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "target_modules": targets}))
    return path


def test_dry_run_lora_flags(tools, hf_dir, tmp_path, capsys):
    examples, _ = tools
    adapter = _peft_dir(tmp_path / "adapter")
    assert script.main(args(hf_dir, tmp_path / "out", examples, "--lora-dir", str(adapter), "--dry-run")) == 0
    build = capsys.readouterr().out.splitlines()[-1]
    assert build.endswith(
        f"--lora_plugin auto --lora_dir {adapter} --lora_ckpt_source hf --lora_target_modules attn_q attn_v "
        "--max_lora_rank 8"
    )
    extra = ["--lora-target-modules", "attn_q", "attn_k", "--max-lora-rank", "16", "--lora-plugin", "float16"]
    assert script.main(args(hf_dir, tmp_path / "out", examples, *extra, "--dry-run")) == 0
    build = capsys.readouterr().out.splitlines()[-1]
    assert build.endswith("--lora_plugin float16 --lora_target_modules attn_q attn_k --max_lora_rank 16")


def test_lora_module_table_is_the_core_s():
    """The build accepts exactly the modules the core converts at registration."""
    from core.engine.trtllm.lora import HF_TO_TRTLLM, MODULE_IDS

    assert script.HF_LORA_MODULES is HF_TO_TRTLLM
    assert script.LORA_MODULES == tuple(MODULE_IDS)
    assert "c_attn" not in HF_TO_TRTLLM


@pytest.mark.parametrize(
    "prepare, extra, message",
    [
        (
            lambda d: _edit_config(d, model_type="gpt_neox"),
            ["--lora-target-modules", "attn_q"],
            "the gptneox family has no LoRA support",
        ),
        (None, ["--lora-dir", "/nonexistent/adapter"], "no readable adapter_config.json"),
        (None, ["--lora-plugin", "auto"], "no modules to adapt"),
        (None, ["--lora-dir", "{wide}", "--max-lora-rank", "4"], "--max-lora-rank 4: must be >= 1"),
        (None, ["--lora-dir", "{odd}"], "module 'embed_tokens' has no TensorRT-LLM LoRA module"),
        # QWen v1's fused c_attn: the core could not register the adapter (HF_TO_TRTLLM).
        (None, ["--lora-dir", "{fused}"], "module 'c_attn' has no TensorRT-LLM LoRA module"),
        (None, ["--lora-dir", "{wide}", "--lora-target-modules", "attn_q"], "lacks attn_v"),
    ],
)
def test_lora_inputs_are_checked(tools, hf_dir, tmp_path, capsys, prepare, extra, message):
    examples, calls = tools
    if prepare is not None:
        prepare(hf_dir)
    dirs = {
        "wide": _peft_dir(tmp_path / "wide", rank=8),
        "odd": _peft_dir(tmp_path / "odd", targets=("embed_tokens",)),
        "fused": _peft_dir(tmp_path / "fused", targets=("c_attn",)),
    }
    extra = [e.format(**dirs) for e in extra]
    assert script.main(args(hf_dir, tmp_path / "out", examples, *extra)) == 2
    assert message in capsys.readouterr().err
    assert [c for c in calls() if c[1:] != ["--help"]] == []
