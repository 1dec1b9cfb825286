"""Server processes started by the benchmarks: free loopback ports, start with a readiness line
in the log, CPU and memory accounting, SIGTERM stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process started for a benchmark (output in bench-results/<name>.log), stopped
    with SIGTERM.

    Raises:
        SystemExit: the process exited, or `ready` did not appear in its log within `timeout` s.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready: str,
        env: dict | None = None,
        timeout: float = 300,
        cwd: Path = ROOT,
    ):
        self.name = name
        log_dir = ROOT / "bench-results"
        log_dir.mkdir(exist_ok=True)
        log = open(log_dir / f"{name}.log", "w")
        self.popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
        )
        self.log_path = Path(log.name)
        deadline = time.monotonic() + timeout
        while ready not in self.log_path.read_text(errors="replace"):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not start; see {self.log_path}")
            time.sleep(0.5)
        self.process = psutil.Process(self.popen.pid)
        print(f"started {name} (pid {self.popen.pid})", flush=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def peak_rss_mb(self) -> float:
        """Peak resident set size (VmHWM) in MiB."""
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the process has used so far (all its threads)."""
        t = self.process.cpu_times()
        return t.user + t.system

    def system_seconds(self) -> float:
        """The kernel's part of `cpu_seconds` (system calls: on loopback a send also runs the
        receiving side's TCP processing)."""
        return self.process.cpu_times().system

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
