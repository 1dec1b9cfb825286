#!/usr/bin/env python
"""Events per second delivered by one ws gateway process, and its CPU cost next to the core's.

N sockets each send batches of P streaming prompts in a closed loop (a new batch as soon as the
previous one completed) until --duration seconds or --rounds batches per socket; every
request_id is new, so no batch continues a session. Measured on the client:
- events/s: event entries received (every ACCEPTED, STARTED, INITIALIZED, PROGRESS, COMPLETE,
  ERROR) over the measurement window, and frames/s (one frame may carry several events);
- per-event latency: for each prompt, the gap between consecutive events (the client-side
  inter-event latency), and the time from sending a batch to each prompt's first PROGRESS (TTFT);
- CPU seconds (user + system) of the gateway and core processes over the window (psutil), their
  ratio, and the client's own.

Against processes started separately:
    python scripts/bench/ws_events.py --url ws://127.0.0.1:8765/ws --core-pid 123 --gateway-pid 456
Or start a core on models/demo and a ws gateway on free loopback ports, and stop them after:
    python scripts/bench/ws_events.py --start --duration 30

Prints progress and a summary table, and writes the figures as JSON (--json-out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Once upon a time",
    "The cat sat on the",
    "In the morning the village",
    "She opened the door and",
    "The old man said that",
    "It was a dark and stormy night",
    "They walked along the river",
    "The king had three sons",
]


@dataclass
class Stats:
    """What the sockets observed."""

    events: int = 0
    frames: int = 0
    prompts_done: int = 0
    errors: int = 0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8765/ws", help="ws gateway URL (ignored with --start)")
    p.add_argument("--sockets", type=int, default=64, help="concurrent sockets")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation_config.max_new_tokens")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to keep sending batches")
    p.add_argument("--rounds", type=int, default=0, help="batches per socket instead of --duration (0: use duration)")
    p.add_argument("--core-pid", type=int, help="core process for CPU accounting")
    p.add_argument("--gateway-pid", type=int, help="gateway process for CPU accounting")
    p.add_argument("--start", action="store_true", help="start a core (--model) and a ws gateway, stop them after")
    p.add_argument("--model", default=str(ROOT / "models" / "demo"), help="model of the core started by --start")
    p.add_argument(
        "--core-args",
        default="--max-batch-size 64 --max-queue-size 1024",
        help="extra flags of the core started by --start",
    )
    p.add_argument("--json-out", default=str(ROOT / "bench-results" / "ws_events.json"), help="where to write JSON")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(url: str, proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args} exited with {proc.returncode}")
        try:
            async with connect(url, open_timeout=2) as ws:
                await ws.send(
                    json.dumps(
                        {
                            "prompts": [{"request_id": f"ready-{time.time_ns()}", "prompt": "Hi"}],
                            "generation_config": {"max_new_tokens": 1},
                        }
                    )
                )
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if any(e.get("type") == "COMPLETE" for e in frame):
                        return
                    if any(e.get("type") == "ERROR" or "error" in e for e in frame):
                        break  # the core is still loading
        except (TimeoutError, OSError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {limit_s:.0f} s: {e}") from None
        await asyncio.sleep(0.5)


def _start(args) -> tuple[str, list[subprocess.Popen]]:
    core_port, gw_port = _free_port(), _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    core = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "core",
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(core_port),
            "--log-level",
            "WARNING",
            *args.core_args.split(),
        ],
        cwd=ROOT,
        env=env,
    )
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateways",
            "ws",
            "--core",
            f"127.0.0.1:{core_port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(gw_port),
            "--env-file",
            "",
            "--log-level",
            "WARNING",
            "--max-in-flight-prompts",
            str(max(256, args.prompts * 2)),
        ],
        cwd=ROOT,
        env=env,
    )
    return f"ws://127.0.0.1:{gw_port}/ws", [core, gateway]


async def _socket(index: int, args, url: str, stats: Stats, stop_at: float) -> None:
    async with connect(url, max_size=None, ping_interval=None) as ws:
        round_no = 0
        while (args.rounds and round_no < args.rounds) or (not args.rounds and time.monotonic() < stop_at):
            ids = [f"bench-{os.getpid()}-{index}-{round_no}-{i}" for i in range(args.prompts)]
            payload = {
                "prompts": [
                    {"request_id": rid, "prompt": PROMPTS[(index + i) % len(PROMPTS)]} for i, rid in enumerate(ids)
                ],
                "stream_response": True,
                "generation_config": {"max_new_tokens": args.max_new_tokens},
            }
            sent = time.monotonic()
            last = dict.fromkeys(ids, sent)
            first_progress: set[str] = set()
            pending = set(ids)
            await ws.send(json.dumps(payload))
            while pending:
                frame = json.loads(await ws.recv())
                now = time.monotonic()
                stats.frames += 1
                for event in frame:
                    stats.events += 1
                    rid = event.get("request_id")
                    if rid not in last:
                        stats.errors += 1
                        stats.error_samples.append(str(event)[:200])
                        pending.clear()
                        continue
                    stats.gaps.append(now - last[rid])
                    last[rid] = now
                    kind = event["type"]
                    if kind == "PROGRESS" and rid not in first_progress:
                        first_progress.add(rid)
                        stats.ttft.append(now - sent)
                    elif kind == "COMPLETE":
                        stats.prompts_done += 1
                        stats.tokens += event["new_tokens_count"]
                        pending.discard(rid)
                    elif kind == "ERROR":
                        stats.errors += 1
                        if len(stats.error_samples) < 5:
                            stats.error_samples.append(event["error"])
                        pending.discard(rid)
            round_no += 1


def _cpu(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    t = proc.cpu_times()
    return t.user + t.system


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _measure(args, url: str, core_pid: int | None, gateway_pid: int | None) -> dict:
    core = psutil.Process(core_pid) if core_pid else None
    gateway = psutil.Process(gateway_pid) if gateway_pid else None
    me = psutil.Process()
    stats = Stats()
    cpu0 = (_cpu(core), _cpu(gateway), _cpu(me))
    start = time.monotonic()
    stop_at = start + args.duration

    async def progress() -> None:
        while True:
            await asyncio.sleep(5)
            elapsed = time.monotonic() - start
            print(
                f"  {elapsed:6.1f} s  {stats.events:8d} events  {stats.events / elapsed:8.0f} events/s  "
                f"{stats.prompts_done:6d} prompts done  {stats.errors} errors",
                flush=True,
            )

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(_socket(i, args, url, stats, stop_at) for i in range(args.sockets)))
    finally:
        reporter.cancel()
    window = time.monotonic() - start
    cpu1 = (_cpu(core), _cpu(gateway), _cpu(me))
    core_cpu, gw_cpu, client_cpu = (None if a is None else b - a for a, b in zip(cpu0, cpu1, strict=True))
    return {
        "config": {
            "url": url,
            "sockets": args.sockets,
            "prompts_per_batch": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "model": args.model if args.start else None,
            "core_args": args.core_args if args.start else None,
            "host": platform.node(),
            "cpus": psutil.cpu_count(),
        },
        "window_s": window,
        "events": stats.events,
        "frames": stats.frames,
        "events_per_s": stats.events / window,
        "frames_per_s": stats.frames / window,
        "events_per_frame": stats.events / max(1, stats.frames),
        "prompts_completed": stats.prompts_done,
        "generated_tokens": stats.tokens,
        "tokens_per_s": stats.tokens / window,
        "errors": stats.errors,
        "error_samples": stats.error_samples[:5],
        "event_gap_ms": {
            "p50": _ms(_pct(stats.gaps, 0.5)),
            "p99": _ms(_pct(stats.gaps, 0.99)),
            "mean": _ms(statistics.fmean(stats.gaps) if stats.gaps else None),
        },
        "ttft_ms": {"p50": _ms(_pct(stats.ttft, 0.5)), "p99": _ms(_pct(stats.ttft, 0.99))},
        "cpu_s": {"gateway": gw_cpu, "core": core_cpu, "client": client_cpu},
        "cpu_share": {
            "gateway_over_core": (gw_cpu / core_cpu) if gw_cpu is not None and core_cpu else None,
            "gateway_cores": None if gw_cpu is None else gw_cpu / window,
            "core_cores": None if core_cpu is None else core_cpu / window,
            "client_cores": client_cpu / window,
        },
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _table(r: dict) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    rows = [
        ("sockets x prompts", f"{r['config']['sockets']} x {r['config']['prompts_per_batch']}"),
        ("window", f(r["window_s"], "{:.1f} s")),
        ("events delivered", str(r["events"])),
        ("events/s", f(r["events_per_s"], "{:.0f}")),
        ("frames/s (events/frame)", f"{r['frames_per_s']:.0f} ({r['events_per_frame']:.2f})"),
        ("prompts completed / errors", f"{r['prompts_completed']} / {r['errors']}"),
        ("generated tokens/s", f(r["tokens_per_s"], "{:.0f}")),
        ("event gap p50 / p99", f"{f(r['event_gap_ms']['p50'])} / {f(r['event_gap_ms']['p99'])} ms"),
        ("TTFT p50 / p99", f"{f(r['ttft_ms']['p50'])} / {f(r['ttft_ms']['p99'])} ms"),
        (
            "CPU s gateway / core / client",
            f"{f(r['cpu_s']['gateway'])} / {f(r['cpu_s']['core'])} / {f(r['cpu_s']['client'])}",
        ),
        ("gateway CPU / core CPU", f(r["cpu_share"]["gateway_over_core"], "{:.3f}")),
        (
            "cores busy gateway / core / client",
            f"{f(r['cpu_share']['gateway_cores'], '{:.2f}')} / {f(r['cpu_share']['core_cores'], '{:.2f}')} / "
            f"{f(r['cpu_share']['client_cores'], '{:.2f}')}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


async def _main(args) -> dict:
    procs: list[subprocess.Popen] = []
    url, core_pid, gateway_pid = args.url, args.core_pid, args.gateway_pid
    try:
        if args.start:
            url, procs = _start(args)
            core_pid, gateway_pid = procs[0].pid, procs[1].pid
            print(f"started core (pid {core_pid}) and ws gateway (pid {gateway_pid}) at {url}", flush=True)
            await _wait_ready(url, procs[1])
        print(
            f"measuring: {args.sockets} sockets x {args.prompts} prompts, max_new_tokens {args.max_new_tokens}, "
            + (f"{args.rounds} rounds" if args.rounds else f"{args.duration:.0f} s"),
            flush=True,
        )
        return await _measure(args, url, core_pid, gateway_pid)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 1 when any prompt failed."""
    args = _parser().parse_args(argv)
    result = asyncio.run(_main(args))
    print(_table(result))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
