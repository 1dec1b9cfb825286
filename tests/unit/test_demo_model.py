"""scripts/make_demo_model.py: a fixed number of steps from a fixed seed gives the same weights
every time, the record next to them says so, and a built models/demo is the documented one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from core.lora import read_spec

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_built_demo_model_is_the_documented_one(demo_script):
    record_path = DEMO / "trellis_demo.json"
    if not record_path.is_file():
        pytest.skip("no demo model: run `make model` first")
    record = json.loads(record_path.read_text())
    assert record["steps"] == demo_script.STEPS
    assert record["seed"] == demo_script.SEED
    assert record["final_loss"] == pytest.approx(demo_script.FINAL_LOSS, abs=demo_script.FINAL_LOSS_TOLERANCE)


def test_built_demo_adapters_change_the_greedy_output(demo_script):
    """The demo adapters of a built models/demo: recorded, accepted by the core, and each
    answers a prompt otherwise than the base model (peft merging each into the weights)."""
    record_path = DEMO / "trellis_demo.json"
    if not (DEMO / "adapters").is_dir() or not record_path.is_file():
        pytest.skip("no demo adapters: run `make model` first")
    record = json.loads(record_path.read_text())
    assert {name: (a["steps"], a["seed"]) for name, a in record["adapters"].items()} == {
        name: (demo_script.ADAPTER_STEPS, seed) for name, seed in demo_script.ADAPTERS.items()
    }
    from transformers import AutoTokenizer

    from tests.lora_helpers import merged_greedy

    prompt = AutoTokenizer.from_pretrained(str(DEMO))("The licence grants you")["input_ids"]
    outputs = {"": merged_greedy(DEMO, None, [prompt], 12)[0]}
    for name in demo_script.ADAPTERS:
        read_spec(name, DEMO / "adapters" / name, max_rank=16, model_path=str(DEMO), served_model="demo")
        outputs[name] = merged_greedy(DEMO, DEMO / "adapters" / name, [prompt], 12)[0]
    assert len({tuple(ids) for ids in outputs.values()}) == len(outputs)


def test_untrained_model_records_no_steps(demo_script, tiny_model_dir):
    record = json.loads((tiny_model_dir / "trellis_demo.json").read_text())
    assert record["steps"] == 0
    assert "adapters" not in record and not (tiny_model_dir / "adapters").exists()
    assert record["seed"] == demo_script.SEED
    assert record["final_loss"] is None


def test_same_steps_and_seed_give_the_same_weights(demo_script, tmp_path, capsys):
    # A short corpus keeps the two builds to a few seconds; the caller's thread count differs
    # between them, and each build leaves it as it found it.
    outputs = []
    threads = torch.get_num_threads()
    try:
        for n, caller_threads in enumerate((1, 2)):
            torch.set_num_threads(caller_threads)
            out = tmp_path / f"demo{n}"
            argv = ["--output", str(out), "--steps", "3", "--corpus-bytes", "200000", "--adapter-steps", "2"]
            assert demo_script.main(argv) == 0
            assert torch.get_num_threads() == caller_threads
            outputs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert _sha256(outputs[0] / "model.safetensors") == _sha256(outputs[1] / "model.safetensors")
    for name in demo_script.ADAPTERS:
        weights = [out / "adapters" / name / "adapter_model.safetensors" for out in outputs]
        assert _sha256(weights[0]) == _sha256(weights[1])
        spec = read_spec(
            name, outputs[0] / "adapters" / name, max_rank=16, model_path=str(outputs[0]), served_model="x"
        )
        assert spec.rank == demo_script.ADAPTER_RANK and spec.base_model == "demo0"
    records = [json.loads((out / "trellis_demo.json").read_text()) for out in outputs]
    assert records[0] == records[1]
    assert records[0]["steps"] == 3
    assert records[0]["seed"] == demo_script.SEED
    assert records[0]["final_loss"] > 0
    assert {name: (a["steps"], a["seed"]) for name, a in records[0]["adapters"].items()} == {
        name: (2, seed) for name, seed in demo_script.ADAPTERS.items()
    }
    printed = capsys.readouterr().out
    assert f"step    3/3  loss {records[0]['final_loss']:.3f}" in printed


def test_another_seed_gives_other_weights(demo_script, tmp_path):
    paths = []
    for seed in (1, 2):
        out = tmp_path / f"seed{seed}"
        args = ["--output", str(out), "--steps", "0", "--seed", str(seed), "--corpus-bytes", "200000"]
        assert demo_script.main(args) == 0
        paths.append(out / "model.safetensors")
    assert _sha256(paths[0]) != _sha256(paths[1])


def test_negative_steps_are_refused(demo_script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        demo_script.main(["--output", str(tmp_path / "demo"), "--steps", "-1"])
    assert exc.value.code == 2
    assert "--steps must be 0 or more, got -1" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
