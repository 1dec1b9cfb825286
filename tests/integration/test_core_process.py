"""The `trellis-core` process: start-up failures (its SIGTERM drain: tests/reliability/test_drain.py)."""

from __future__ import annotations

import asyncio
import sys


async def test_unusable_model_directory_fails_at_start(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "core",
        "--model",
        str(tmp_path / "missing"),
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode != 0
    assert b"missing" in out
