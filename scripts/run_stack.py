"""Start the whole stack: one core and every gateway, on the default ports, until Ctrl-C.

Usage: python scripts/run_stack.py --model models/demo [--engine hf] [--only core,openai]

The core starts first; gateways start once its grpc.health.v1 check answers SERVING. Each
process's output is prefixed with its name. SIGINT/SIGTERM stops the gateways, then drains the core.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

GATEWAYS = {"lmi": 8080, "openai": 8000, "triton": 8001, "ws": 8765}


def _pump(name: str, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float) -> None:
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the core exited with status {proc.returncode}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            time.sleep(0.5)
    raise SystemExit(f"the core did not become ready within {timeout:.0f} s")


def main() -> int:
    """Run until interrupted; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--engine", default="hf")
    p.add_argument("--core-port", type=int, default=50051)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--only", default="", help="comma-separated subset of: core," + ",".join(GATEWAYS))
    args = p.parse_args()
    wanted = set(args.only.split(",")) if args.only else {"core", *GATEWAYS}
    address = f"{args.host}:{args.core_port}"
    procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=_pump, args=(name, proc), daemon=True).start()
        procs.append((name, proc))
        return proc

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if "core" in wanted:
            core = spawn(
                "core",
                [
                    sys.executable,
                    "-m",
                    "core",
                    "--model",
                    args.model,
                    "--engine",
                    args.engine,
                    "--host",
                    args.host,
                    "--port",
                    str(args.core_port),
                ],
            )
            _wait_serving(address, core, timeout=300)
        for name, port in GATEWAYS.items():
            if name in wanted:
                spawn(
                    name,
                    [
                        sys.executable,
                        "-m",
                        "gateways",
                        name,
                        "--core",
                        address,
                        "--host",
                        args.host,
                        "--port",
                        str(port),
                    ],
                )
        print(
            f"stack is up: core {address}; "
            + ", ".join(f"{n} http://{args.host}:{p}" for n, p in GATEWAYS.items() if n in wanted)
            + " (Ctrl-C stops)",
            flush=True,
        )
        while not stop.is_set():
            if any(proc.poll() is not None for _, proc in procs):
                name = next(n for n, proc in procs if proc.poll() is not None)
                print(f"{name} exited; stopping the stack", flush=True)
                break
            stop.wait(0.5)
    finally:
        for _, proc in reversed(procs):  # gateways first, then the core drains
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
