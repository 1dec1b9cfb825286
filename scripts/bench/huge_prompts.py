"""What huge prompts cost everyone else: a core on the mock engine, a small greedy request's
latency while eight 1.5 MB prompts are refused at the same time (against the same request
alone), the time to refuse one 10 MB prompt, and the core's RSS before and after.

Usage: python scripts/bench/huge_prompts.py --model models/demo [--json out.json]
Prints progress and one JSON object of figures (seconds, MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _request(text: str) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(do_sample=False), stopping=pb.StoppingParams(max_new_tokens=4)
    )


async def _timed(stub: spb_grpc.GenerateServiceStub, text: str) -> float:
    started = time.perf_counter()
    try:
        async for _ in stub.Generate(_request(text)):
            pass
    except grpc.aio.AioRpcError:
        pass
    return time.perf_counter() - started


async def _measure(address: str, pid: int) -> dict[str, float]:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        for _ in range(5):
            await _timed(stub, "Hello there")
        alone = sorted([await _timed(stub, "Hello there") for _ in range(10)])[5]
        print(f"small request alone: {alone * 1000:.1f} ms", file=sys.stderr, flush=True)
        rss_before = _rss_mib(pid)
        huge = "word " * 300_000  # 1.5 MB
        results = await asyncio.gather(*[_timed(stub, huge) for _ in range(8)], _timed(stub, "Hello there"))
        during = results[-1]
        print(f"small request beside 8 x 1.5 MB: {during * 1000:.1f} ms", file=sys.stderr, flush=True)
        ten = await _timed(stub, "word " * 2_000_000)
        print(f"10 MB prompt refused in {ten:.2f} s", file=sys.stderr, flush=True)
        return {
            "small_alone_s": alone,
            "small_beside_8x1.5MB_s": during,
            "huge_8x1.5MB_max_s": max(results[:-1]),
            "refuse_10MB_s": ten,
            "rss_before_mib": rss_before,
            "rss_after_mib": _rss_mib(pid),
            "loadavg_1m": os.getloadavg()[0],
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "core", "--engine", "mock", "--model", args.model, "--port", str(port)]
    cmd += ["--max-message-bytes", str(64 << 20), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        print(proc.stdout.readline().strip(), file=sys.stderr, flush=True)
        figures = asyncio.run(_measure(f"127.0.0.1:{port}", proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
