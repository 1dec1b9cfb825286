"""CI check: a gateway installs and runs without torch.

Creates a fresh virtualenv in a temporary directory, installs only `trellis[gateway]` from a copy
of this checkout (not editable, so the check sees what a wheel ships, and the build leaves
nothing in the checkout), asserts that torch and
transformers are not installed, then starts each gateway against a core that is not there
(127.0.0.1:1) and checks that it answers on loopback: LMI `/ping` and OpenAI `/health` with 503
(core not serving), Triton `/v2/health/live` with 200 and `/v2/health/ready` with 400, the
WebSocket gateway's `/ws` with 426 to a plain HTTP request. Every process it starts is stopped.

Usage: python3 scripts/check_gateway_install.py   (pip's cache makes repeated runs fast)
Exit status 0 when every check passed; the first failure is printed and exits 1.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE_CORE = "127.0.0.1:1"
# gateway -> [(path, expected status)]
PROBES = {
    "lmi": [("/ping", 503)],
    "openai": [("/health", 503)],
    "triton": [("/v2/health/live", 200), ("/v2/health/ready", 400)],
    "ws": [("/ws", 426)],
}
START_TIMEOUT_S = 60


def step(message: str) -> None:
    print(f"[gateway-check] {message}", flush=True)


def fail(message: str) -> None:
    print(f"[gateway-check] FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


# What the copy of the checkout leaves out: local environments, caches and build outputs.
SKIP = (".git", ".venv", "models", "build", "*.egg-info", "__pycache__", "bench-results", ".*_cache")


def install(tmp: Path) -> Path:
    """A fresh virtualenv with `.[gateway]` installed; returns its bin directory."""
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*SKIP))
    env_dir = tmp / "venv"
    step(f"creating a virtualenv in {env_dir}")
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    step("installing .[gateway] (no torch)")
    started = time.monotonic()
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", f"{source}[gateway]"], check=True, cwd=tmp)
    step(f"installed in {time.monotonic() - started:.1f} s")
    return bin_dir


def check_absent(bin_dir: Path) -> None:
    code = (
        "import importlib.util, json; "
        "print(json.dumps([m for m in ('torch', 'transformers', 'tokenizers') if importlib.util.find_spec(m)]))"
    )
    found = json.loads(subprocess.run([str(bin_dir / "python"), "-c", code], check=True, capture_output=True).stdout)
    if found:
        fail(f"the gateway install brought {', '.join(found)}")
    step("torch, transformers and tokenizers are not installed")


def start(bin_dir: Path, name: str, cwd: Path) -> tuple[subprocess.Popen[str], int]:
    """Start `trellis-gateway <name>` on a free port; returns the process and its port."""
    proc = subprocess.Popen(
        [str(bin_dir / "trellis-gateway"), name, "--port", "0", "--core", UNREACHABLE_CORE],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # Lines are read on a thread, so a gateway that prints something else and then hangs is
    # reported after START_TIMEOUT_S instead of blocking the check forever.
    lines_q: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines_q.put(line) for line in proc.stdout or ()], daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    lines = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines_q.get(timeout=left)
        except queue.Empty:
            break
        lines.append(line)
        if line.startswith(f"trellis-gateway {name} on http://"):
            return proc, int(line.split("http://", 1)[1].split(" ", 1)[0].rsplit(":", 1)[1])
    proc.kill()
    proc.wait()
    fail(f"trellis-gateway {name} did not start:\n{''.join(lines)}")
    raise AssertionError  # unreachable


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="trellis-gateway-check-") as tmp:
        bin_dir = install(Path(tmp))
        check_absent(bin_dir)
        for name, probes in PROBES.items():
            proc, port = start(bin_dir, name, Path(tmp))
            try:
                for path, expected in probes:
                    status = probe(port, path)
                    if status != expected:
                        fail(f"{name} {path}: status {status}, expected {expected}")
                    step(f"{name} answers {path} with {status}")
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    step("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
