"""NVIDIA's aiperf, unmodified, benchmarking the OpenAI gateway for a few seconds as its own docs
advise for vLLM: streaming chat, `--extra-inputs min_tokens:N` (vLLM's extension, sent in every
request body) and `--use-server-token-count` (token counts from the gateway's `usage`, which
makes aiperf ask for `stream_options.include_usage`). The gateway fronts an in-process mock core
whose every step draws EOS with probability 1/2, so without `min_tokens` nearly every reply would
end within a few tokens; aiperf's tokenizer is the tiny model's, from its directory.

aiperf lives in a virtualenv of its own (its pins clash with the project's: huggingface_hub<2,
pandas 2.3), which `make test` creates from tests/integration/aiperf-requirements.txt under
.cache/aiperf-venv; TRELLIS_AIPERF names another `aiperf` executable. Without it the test skips,
or fails under CI=true, where `make test` should have made it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AIPERF = Path(os.environ.get("TRELLIS_AIPERF") or ROOT / ".cache" / "aiperf-venv" / "bin" / "aiperf")
MIN_TOKENS = 12
MAX_TOKENS = 24
SECONDS = 3
LIMIT_S = 240.0  # aiperf's whole run: startup, the benchmark, its reports


def aiperf_executable() -> Path:
    """The aiperf executable; skips the test where it is missing, fails instead under CI=true."""
    if AIPERF.is_file() and os.access(AIPERF, os.X_OK):
        return AIPERF
    reason = f"aiperf is not installed at {AIPERF} (`make test` creates its virtualenv)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def aiperf_env(tmp: Path) -> dict[str, str]:
    """The environment aiperf runs in: the test's, less what belongs to the project's venv, and
    without HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: aiperf 0.13.0 (aiperf/common/tokenizer.py,
    `_load_from_hub`) reads a local tokenizer directory as a Hub repository id when either is
    set, and fails. A local path is loaded from disk either way. An empty HF_HOME and TMPDIR
    under `tmp` keep its caches, ZeroMQ sockets and memory-mapped dataset files there."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HOME=str(tmp / "hf"), TMPDIR=str(tmp), HF_HUB_DISABLE_TELEMETRY="1")
    (tmp / "hf").mkdir(exist_ok=True)
    return env


async def run_aiperf(aiperf: Path, args: list[str]) -> str:
    """Runs aiperf to completion in its own process group; returns its output (stdout and stderr
    together). Raises AssertionError, with the output's end, if it exits non-zero or outlives
    LIMIT_S seconds (its whole process group is killed then). aiperf also exits 0 after some
    failures (one of its services failing to start): callers check the files it wrote."""
    # aiperf's ZeroMQ ipc:// sockets live under TMPDIR, and a socket path is limited to 107
    # bytes (sockaddr_un.sun_path): pytest's tmp_path is too deep for them.
    tmp = Path(tempfile.mkdtemp(prefix="aiperf-"))
    try:
        proc = await asyncio.create_subprocess_exec(
            str(aiperf),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=aiperf_env(tmp),
            cwd=tmp,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), LIMIT_S)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = await proc.communicate()
            raise AssertionError(f"aiperf ran past {LIMIT_S} s:\n{out.decode(errors='replace')[-4000:]}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"aiperf exited {proc.returncode}:\n{text[-4000:]}"
    return text


async def test_aiperf_min_tokens_with_server_token_counts(start_mock_core, start_gateway, tiny_model_dir, tmp_path):
    aiperf = aiperf_executable()
    core = await start_mock_core(mock_eos_probability=0.5)
    url = await start_gateway("openai", core=core.address)
    artifacts = tmp_path / "artifacts"
    output = await run_aiperf(
        aiperf,
        [
            "profile",
            "--model", "mock",
            "--url", url,
            "--endpoint-type", "chat",
            "--streaming",
            "--tokenizer", str(tiny_model_dir),
            "--use-server-token-count",
            "--extra-inputs", f"min_tokens:{MIN_TOKENS}",
            "--prompt-input-tokens-mean", "16",
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(MAX_TOKENS),
            "--prompt-output-tokens-stddev", "0",
            "--concurrency", "2",
            "--benchmark-duration", str(SECONDS),
            "--random-seed", "7",
            "--artifact-dir", str(artifacts),
            "--ui-type", "none",
            "--no-gpu-telemetry",
            "--no-server-metrics",
            "--workers-max", "1",
            "--record-processors", "1",
        ]
    )  # fmt: skip
    assert (artifacts / "profile_export.jsonl").is_file(), f"aiperf wrote no records:\n{output[-4000:]}"

    # What aiperf sent: vLLM's min_tokens beside its own fields, and a request for usage.
    sent = [p for conv in json.loads((artifacts / "inputs.json").read_text())["data"] for p in conv["payloads"]]
    assert sent and all(p["min_tokens"] == MIN_TOKENS for p in sent)
    assert all(p["stream_options"] == {"include_usage": True} and p["stream"] for p in sent)

    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0.0
    assert summary["completed_request_count"]["avg"] >= 2

    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    assert records and all("error" not in r for r in records)
    for record in records:
        metrics = record["metrics"]
        served = metrics["usage_completion_tokens"]["value"]
        # Counted by the gateway, not re-tokenized by aiperf; min_tokens held back EOS (which
        # the count includes, as vLLM's does) and max_completion_tokens bounded the reply.
        assert metrics["output_sequence_length"]["value"] == served
        assert MIN_TOKENS <= served <= MAX_TOKENS, record
