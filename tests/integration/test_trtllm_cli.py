"""Process-level guarantees: `import core` (and the HF engine) never imports TensorRT-LLM, and
`trellis-core --engine trtllm[-llm]` without it exits with status 2 naming the `trtllm` extra."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


async def _run(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def test_import_core_never_imports_tensorrt_llm():
    code = (
        "import sys, core, core.server, core.engine.registry, core.engine.hf, core.engine.trtllm.executor, "
        "core.engine.trtllm.llm, core.engine.trtllm.defaults\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorrt_llm')\n"
        "print('imported:', bad); sys.exit(1 if bad else 0)"
    )
    rc, out = await _run("-c", code)
    assert rc == 0, out


@pytest.mark.parametrize("engine", ["trtllm", "trtllm-llm"])
async def test_engine_without_tensorrt_llm_exits_2(tiny_model_dir, engine):
    rc, out = await _run("-m", "core", "--engine", engine, "--model", str(tiny_model_dir), "--port", "0")
    assert rc == 2, out
    assert "pip install 'trellis[trtllm]'" in out
