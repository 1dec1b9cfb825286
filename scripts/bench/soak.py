"""`make soak`: the reliability suite's long run, with figures (issue 15), written to
bench-results/reliability.json and summarised on stdout.

Every process is real and on loopback: a core on the mock engine (the model's tokenizer only)
on one fixed port, restarted there between sections, and the four gateways in front of it, up
for the whole run. Sections, in order:

1. disconnect storm: a core with --max-batch-size 4; `--storm-streams` streams across the
   gateways abandoned at random points (before the first byte, after 0-10 records, mid-WebSocket
   batch); afterwards the core's running and waiting requests (its Prometheus gauges), its RSS
   against before (after a warm-up storm), and the time one request per gateway sent together
   takes (a leaked slot of the 4 would hold one back);
2. fuzz: each fuzz source (a callable returning {"cases", "4xx", "5xx", "deaths", "tracebacks"})
   against a core with room for 64 sequences;
3. soak: `--soak-seconds` of `--streams-per-gateway` closed-loop streams through each gateway
   (64 in all by default): errors, RSS of every process each 10 s with its least-squares slope
   in MiB/min, TTFT and ITL p50/p99 of the requests started in the first and in the last minute;
4. core kill: SIGKILL with a stream in flight through each gateway, restart on the same port,
   seconds from the core's readiness to each gateway's first success;
5. drain: SIGTERM with streams in flight: their completion, the refusal time of new calls, the
   exit time against --drain-seconds.

The scenario functions are the tests' own (tests/reliability/scenarios.py, fuzzing.py); a
section that sees a problem lists it, and the exit status is 1 if any did.

Usage: python scripts/bench/soak.py [--soak-seconds 600] [--model models/demo]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import ROOT, Proc, free_port

sys.path.insert(0, str(ROOT))
from tests.integration.core_helpers import start_core_process
from tests.integration.gateway_helpers import GATEWAYS, PROBES, first_success, ws_url
from tests.reliability import fuzzing, scenarios

FuzzSource = Callable[[], Awaitable[dict[str, Any]]]
FIGURES = ("cases", "4xx", "5xx", "deaths", "tracebacks")
RSS_EVERY_S = 10.0
MIB = 1024 * 1024


class Core:
    """A core process on the mock engine serving model "mock" on 127.0.0.1:`port`; its output
    goes to bench-results/<name>.log (copied by a task, so the pipe never fills)."""

    def __init__(self, name: str, model: str, port: int, *flags: str):
        self.name, self.port = name, port
        self.args = ("--model", model, "--engine", "mock", "--model-name", "mock", "--port", str(port))
        # Room for the scenarios' long streams whatever the model's own context length.
        self.args += ("--mock-context-length", "8192", "--log-level", "WARNING", *flags)
        self.log = ROOT / "bench-results" / f"{name}.log"

    async def start(self) -> None:
        """Start it and return once it serves."""
        self.log.parent.mkdir(exist_ok=True)
        self.proc, self.address = await start_core_process(*self.args)
        self.process = psutil.Process(self.proc.pid)
        self.copier = asyncio.create_task(self._copy())

    async def _copy(self) -> None:
        with open(self.log, "wb") as out:  # noqa: ASYNC230 (small writes to a local file)
            while line := await self.proc.stdout.readline():
                out.write(line)
                out.flush()

    def alive(self) -> bool:
        return self.proc.returncode is None

    def rss_mib(self) -> float:
        return self.process.memory_info().rss / MIB

    async def wait(self) -> int:
        rc = await self.proc.wait()
        await self.copier
        return rc

    async def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
        await self.wait()

    def tracebacks(self) -> int:
        return _tracebacks(self.log)


def _tracebacks(log: Path) -> int:
    return log.read_text(errors="replace").count("Traceback") if log.exists() else 0


def start_gateways(core_port: int) -> tuple[dict[str, Proc], dict[str, str]]:
    """The four gateway processes in front of the core at `core_port`, and their base URLs."""
    procs, urls = {}, {}
    for name in GATEWAYS:
        port = free_port()
        extra = ["--env-file", ""] if name == "ws" else []
        cmd = [sys.executable, "-m", "gateways", name, "--core", f"127.0.0.1:{core_port}", "--port", str(port)]
        procs[name] = Proc(f"soak-gateway-{name}", [*cmd, "--log-level", "WARNING", *extra], ready="trellis-gateway")
        urls[name] = f"http://127.0.0.1:{port}"
    return procs, urls


async def core_gauges(metrics_port: int) -> dict[str, float]:
    """The core's running and waiting requests, from its Prometheus metrics."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
        text = await r.text()
    names = {"trellis_core_num_requests_running": "running", "trellis_core_num_requests_waiting": "waiting"}
    return {
        names[family.name]: family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.name in names and family.samples
    }


async def until_idle(metrics_port: int, within: float) -> tuple[dict[str, float], float]:
    """The gauges once running and waiting are both 0 (or at `within` s), and the seconds it took."""
    started = time.monotonic()
    while True:
        gauges = await core_gauges(metrics_port)
        if (gauges.get("running"), gauges.get("waiting")) == (0, 0) or time.monotonic() - started > within:
            return gauges, time.monotonic() - started
        await asyncio.sleep(0.1)


async def serving(urls: dict[str, str]) -> None:
    """Return once every gateway has served a call (they reconnect to a new core on their own)."""
    async with aiohttp.ClientSession() as http:
        since = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(first_success(PROBES[n], http, urls[n], since) for n in GATEWAYS)), 60)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# ------------------------------------------------------------------------------ 1. disconnect storm


async def storm_section(model: str, port: int, urls: dict[str, str], streams: int) -> dict[str, Any]:
    metrics = free_port()
    flags = ("--max-batch-size", "4", "--max-queue-size", str(2 * streams), "--mock-step-ms", "5")
    core = Core("soak-core-storm", model, port, *flags, "--metrics-port", str(metrics))
    await core.start()
    try:
        await serving(urls)
        say("storm: warm-up (100 streams)")
        await scenarios.storm(urls, 100, random.Random(1), max_records=10, concurrency=100)
        await until_idle(metrics, 30)
        rss_before = core.rss_mib()
        say(f"storm: {streams} streams abandoned at random points (core RSS {rss_before:.1f} MiB)")
        started = time.monotonic()
        storm = await scenarios.storm(urls, streams, random.Random(7), max_records=10, concurrency=100)
        took = time.monotonic() - started
        gauges, idle_s = await until_idle(metrics, 10)
        rss_after = core.rss_mib()
        next_s = await scenarios.next_requests_start(urls)
        out = {
            **storm,
            "seconds": round(took, 1),
            "after": {k: int(gauges[k]) if k in gauges else None for k in ("running", "waiting")},
            "idle_after_s": round(idle_s, 2),
            "core_rss_mib": {"before": round(rss_before, 1), "after": round(rss_after, 1)},
            "core_rss_change_pct": round(100 * (rss_after - rss_before) / rss_before, 2),
            "next_requests_s": round(next_s, 3),
            "max_batch_size": 4,
        }
        problems = []
        if out["after"] != {"running": 0, "waiting": 0}:
            problems.append(f"the core reports {out['after']} after the storm")
        if abs(out["core_rss_change_pct"]) > 5:
            problems.append(f"core RSS changed by {out['core_rss_change_pct']}%")
        out["problems"] = problems
        return out
    finally:
        await core.stop()


# ------------------------------------------------------------------------------ 2. fuzz


def checked(run: Callable[[], Awaitable[dict[str, Any]]], core: Core, gateways: dict[str, Proc]) -> FuzzSource:
    """A fuzz source from a runner of tests/reliability/fuzzing.py: adds process deaths and the
    tracebacks that appeared in every process's log while it ran."""

    async def source() -> dict[str, Any]:
        logs = [g.log_path for g in gateways.values()]
        before = core.tracebacks() + sum(_tracebacks(p) for p in logs)
        figures = await run()
        figures["deaths"] = (not core.alive()) + sum(g.popen.poll() is not None for g in gateways.values())
        figures["tracebacks"] = core.tracebacks() + sum(_tracebacks(p) for p in logs) - before
        return figures

    return source


def schemathesis_source(model: str, examples: int) -> FuzzSource | None:
    """Schemathesis against each gateway's /openapi.json, by tests/reliability/fuzz_figures.py
    (its own core and gateway processes on `model`'s tokenizer, `examples` hypothesis examples
    per operation and generation mode); None where that module or schemathesis is missing."""
    try:
        from tests.reliability.fuzz_figures import fuzz_figures
    except ImportError:
        return None

    async def source() -> dict[str, Any]:
        per_gateway = await asyncio.to_thread(fuzz_figures, model, max_examples=examples, log=say)
        total = {k: sum(f.get(k, 0) for f in per_gateway.values()) for k in (*FIGURES, "failures")}
        return {**total, "gateways": per_gateway}

    return source


async def fuzz_section(sources: dict[str, FuzzSource]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, source in sources.items():
        say(f"fuzz: {name}")
        started = time.monotonic()
        figures = await source()
        figures["seconds"] = round(time.monotonic() - started, 1)
        out[name] = figures
        say(f"fuzz: {name}: " + ", ".join(f"{k} {figures.get(k)}" for k in FIGURES))
    out["total"] = {k: sum(f.get(k, 0) for f in out.values()) for k in FIGURES}
    bad = {k: v for k, v in out["total"].items() if k in ("5xx", "deaths", "tracebacks") and v}
    out["problems"] = [f"fuzz: {bad}"] if bad else []
    # schemathesis also counts answers that differ from the gateway's own document.
    out["problems"] += [
        f"fuzz: {name}: {f['failures']} answers differ from the document"
        for name, f in out.items()
        if isinstance(f, dict) and isinstance(f.get("failures"), int) and f["failures"]
    ]
    return out


# ------------------------------------------------------------------------------ 3. soak


def _is_token(name: str, line: bytes) -> bool:
    if name == "openai":
        return line.startswith(b"data:") and b'"content":"' in line and b'"content":""' not in line
    if name == "lmi":
        return line.startswith(b"{") and b'"token"' in line
    return line.startswith(b"data:") and b'"text_output"' in line


async def timed_stream(name: str, url: str, http: aiohttp.ClientSession, tokens: int, rid: str) -> dict[str, Any]:
    """One stream of `tokens` tokens through gateway `name` at `url`: its TTFT and ITLs (s) and
    what shows it did not finish complete (scenarios.complete_problems)."""
    start = time.perf_counter()
    arrivals: list[float] = []
    if name == "ws":
        events: list[dict] = []
        async with connect(ws_url(url), max_size=None) as sock:
            await sock.send(scenarios.ws_frame([rid], tokens))
            while not events or events[-1].get("type") not in ("COMPLETE", "ERROR"):
                got = json.loads(await sock.recv())
                now = time.perf_counter()
                arrivals += [now for e in got if e.get("type") == "PROGRESS"]
                events += got
        result: Any = events
    else:
        req_url, body = scenarios.stream_request(name, url, tokens)
        lines = []
        async with http.post(req_url, json=body) as resp:
            async for line in resp.content:
                if _is_token(name, line):
                    arrivals.append(time.perf_counter())
                lines.append(line.decode())
        result = (resp.status, "".join(lines))
    return {
        "ttft": arrivals[0] - start if arrivals else None,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "problems": scenarios.complete_problems(name, result, tokens),
    }


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) samples, in MiB/min."""
    if len(samples) < 2:
        return None
    return 60 * statistics.linear_regression([t for t, _ in samples], [m for _, m in samples]).slope


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": round(1000 * statistics.median(values), 2), "p99": round(1000 * q[98], 2)}


async def soak_section(
    urls: dict[str, str], procs: dict[str, psutil.Process], seconds: float, per_gateway: int, tokens: int
) -> dict[str, Any]:
    records: list[tuple[float, str, dict[str, Any]]] = []  # (start s, gateway, result)
    errors: list[str] = []
    rss: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def worker(name: str, w: int, http: aiohttp.ClientSession) -> None:
        k = 0
        while time.monotonic() < deadline:
            start = time.monotonic() - t0
            k += 1
            try:
                result = await timed_stream(name, urls[name], http, tokens, f"soak-{w}-{k}")
            except Exception as e:  # counted as an error, and the loop goes on
                result = {"ttft": None, "itl": [], "problems": [f"{type(e).__name__}: {e}"]}
            records.append((start, name, result))
            errors.extend(f"{name}: {p}" for p in result["problems"])

    async def sampler() -> None:
        while True:
            now = time.monotonic() - t0
            for name, p in procs.items():
                rss[name].append((now, p.memory_info().rss / MIB))
            load = os.getloadavg()[0]
            rss_now = " ".join(f"{n} {v[-1][1]:.0f}" for n, v in rss.items())
            done = f"{len(records)} requests, {len(errors)} errors"
            say(f"soak {now:5.0f}/{seconds:.0f} s: {done}, RSS MiB {rss_now}, load {load:.1f}")
            if now >= seconds:
                return
            await asyncio.sleep(min(RSS_EVERY_S, max(0.0, seconds - now)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(n, w, http) for n in GATEWAYS for w in range(per_gateway)))
        await sampling

    def window(lo: float, hi: float) -> dict[str, Any]:
        rs = [r for s, _, r in records if lo <= s < hi]
        return {
            "requests": len(rs),
            "ttft_ms": percentiles_ms([r["ttft"] for r in rs if r["ttft"] is not None]),
            "itl_ms": percentiles_ms([x for r in rs for x in r["itl"]]),
        }

    minute = min(60.0, seconds)
    # The first minute is warm-up (allocator pools, caches, connection buffers grow to their
    # working size); the slope that tells a leak is the one after it, where the run is long
    # enough to have one (over 2 minutes), else the whole run's.
    settled = {name: [(t, m) for t, m in v if t >= minute] if seconds > 120 else v for name, v in rss.items()}
    slopes = {name: slope_mib_per_min(v) for name, v in settled.items()}
    out = {
        "seconds": seconds,
        "streams": per_gateway * len(GATEWAYS),
        "streams_per_gateway": per_gateway,
        "tokens_per_request": tokens,
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:10],
        "rss_mib": {name: [round(m, 1) for _, m in v] for name, v in rss.items()},
        "rss_slope_mib_per_min": {n: _round(s, 3) for n, s in slopes.items()},
        "rss_slope_from_s": minute if seconds > 120 else 0.0,
        "rss_slope_whole_run_mib_per_min": {n: _round(slope_mib_per_min(v), 3) for n, v in rss.items()},
        "first_minute": window(0, minute),
        "last_minute": window(seconds - minute, seconds),
    }
    problems = [f"soak: {len(errors)} errors"] if errors else []
    problems += [f"{n}: RSS slope {s:.2f} MiB/min" for n, s in slopes.items() if s is not None and s >= 1]
    out["problems"] = problems
    return out


# ------------------------------------------------------------------------------ run


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    gateways, urls = start_gateways(port)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
    report["load_before"] = os.getloadavg()
    try:
        report["disconnect_storm"] = await storm_section(args.model, port, urls, args.storm_streams)
        say(f"storm: {report['disconnect_storm']}")

        flags = ("--max-batch-size", "64", "--max-queue-size", "1024", "--mock-step-ms", str(args.step_ms))
        core = Core("soak-core", args.model, port, *flags, "--drain-seconds", str(args.drain_seconds))
        await core.start()
        await serving(urls)
        sources: dict[str, FuzzSource | None] = {
            "http_bodies": checked(lambda: fuzzing.fuzz_http(urls, args.fuzz_cases), core, gateways),
            "websocket_frames": checked(lambda: fuzzing.fuzz_ws(urls["ws"], args.fuzz_cases), core, gateways),
            "grpc_requests": checked(lambda: fuzzing.fuzz_grpc(core.address, args.fuzz_cases), core, gateways),
            "schemathesis": schemathesis_source(args.model, args.schemathesis_examples),
        }
        report["fuzz"] = await fuzz_section({k: v for k, v in sources.items() if v is not None})
        if sources["schemathesis"] is None:
            report["fuzz"]["schemathesis"] = "not run: tests/reliability/fuzz_figures.py or schemathesis missing"

        procs = {"core": core.process, **{f"gateway-{n}": g.process for n, g in gateways.items()}}
        say(f"soak: {args.soak_seconds:.0f} s, {args.streams_per_gateway} streams per gateway")
        report["soak"] = await soak_section(urls, procs, args.soak_seconds, args.streams_per_gateway, args.tokens)

        say("core kill: SIGKILL with a stream in flight through each gateway")

        async def kill() -> None:
            core.proc.kill()
            await core.wait()

        async def restart() -> None:
            nonlocal core
            core = Core("soak-core-restarted", args.model, port, *flags, "--drain-seconds", str(args.drain_seconds))
            await core.start()

        report["core_kill"] = await scenarios.core_kill(urls, kill, restart, outage_s=2.0)
        slow = {n: s for n, s in report["core_kill"]["recovery_s"].items() if s > 5}
        report["core_kill"]["problems"] += [f"recovery over 5 s: {slow}"] if slow else []
        say(f"core kill: {report['core_kill']}")

        say("drain: SIGTERM with a stream in flight through each gateway and on gRPC")
        drain_tokens = int(0.5 * args.drain_seconds * 1000 / max(args.step_ms, 1))
        report["drain"] = await scenarios.drain(
            urls, core.address, core.proc.terminate, core.wait, args.drain_seconds, drain_tokens
        )
        report["drain"].update(drain_seconds=args.drain_seconds, tokens=drain_tokens)
        say(f"drain: {report['drain']}")
        report["gateway_deaths"] = sum(g.popen.poll() is not None for g in gateways.values())
        report["gateway_tracebacks"] = sum(_tracebacks(g.log_path) for g in gateways.values())
    finally:
        for g in gateways.values():
            g.stop()
    report["load_after"] = os.getloadavg()
    return report


def print_summary(report: dict[str, Any]) -> None:
    s, f, k, d = (report.get(x, {}) for x in ("disconnect_storm", "fuzz", "soak", "core_kill"))
    print("\nreliability figures")
    if s:
        print(
            f"  disconnect storm: {s['streams']} streams ({s['before_first_byte']} before the first byte) in "
            f"{s['seconds']} s; after: running {s['after']['running']}, waiting {s['after']['waiting']}; core RSS "
            f"{s['core_rss_mib']['before']} -> {s['core_rss_mib']['after']} MiB ({s['core_rss_change_pct']:+}%); "
            f"next 4 requests (batch 4) served in {s['next_requests_s']} s"
        )
    if f:
        for name, figures in f.items():
            if isinstance(figures, dict) and "cases" in figures:
                print(f"  fuzz {name:<17} " + "  ".join(f"{x} {figures.get(x)}" for x in FIGURES))
    if k:
        print(
            f"  soak: {k['seconds']:.0f} s at {k['streams']} streams ({k['streams_per_gateway']} per gateway), "
            f"{k['requests']} requests, {k['errors']} errors"
        )
        for name, slope in k["rss_slope_mib_per_min"].items():
            mib = k["rss_mib"][name]
            print(
                f"    RSS {name:<16} {mib[0]:7.1f} -> {mib[-1]:7.1f} MiB, slope {slope} MiB/min from "
                f"{k['rss_slope_from_s']:.0f} s ({k['rss_slope_whole_run_mib_per_min'][name]} over the whole run)"
            )
        for label in ("first_minute", "last_minute"):
            w = k[label]
            ttft, itl = w["ttft_ms"], w["itl_ms"]
            print(
                f"    {label:<12} {w['requests']:5d} requests  TTFT p50/p99 {ttft['p50']}/{ttft['p99']} ms  "
                f"ITL p50/p99 {itl['p50']}/{itl['p99']} ms"
            )
    if d:
        print(f"  core kill: first success after the core is back (s) {d['recovery_s']}")
        print(f"    readiness routes not ready after the kill (s) {d['not_ready_s']}")
    if "drain" in report:
        r = report["drain"]
        print(f"  drain: exit {r['exit_s']} s after SIGTERM (--drain-seconds {r['drain_seconds']})")
        print(f"    new calls refused after (s) {r['refusal_s']}")
    problems = report.get("problems", [])
    print(f"  problems: {problems if problems else 'none'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo", help="a model directory (only its tokenizer is used)")
    p.add_argument("--soak-seconds", type=float, default=600.0, help="length of the soak section")
    p.add_argument("--streams-per-gateway", type=int, default=16, help="soak streams through each gateway")
    p.add_argument("--tokens", type=int, default=64, help="tokens per soak request")
    p.add_argument("--step-ms", type=float, default=10.0, help="mock engine decode step (ms)")
    p.add_argument("--storm-streams", type=int, default=1000)
    p.add_argument("--fuzz-cases", type=int, default=500, help="hypothesis examples per fuzz strategy")
    p.add_argument(
        "--schemathesis-examples", type=int, default=100, help="schemathesis examples per operation and mode"
    )
    p.add_argument("--drain-seconds", type=float, default=5.0)
    p.add_argument("--output", default=str(ROOT / "bench-results" / "reliability.json"))
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    report["problems"] = [
        f"{section}: {p}"
        for section in ("disconnect_storm", "fuzz", "soak", "core_kill", "drain")
        for p in report.get(section, {}).get("problems", [])
    ]
    out = Path(args.output)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"wrote {out}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
