"""`make soak`: the reliability suite's long run, with figures, written to
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
   exit time against --drain-seconds;
6. slow readers: `--slow-readers` streams through an OpenAI gateway read at 1 byte/s for
   `--slow-reader-seconds`: the gateway's and the core's RSS against the bound the gateway's
   --max-buffered-bytes sets;
7. abuse stall: the longest gap between two tokens of a running stream while 8 gzip bodies that
   expand to 1 GiB and 4 chat bodies of 1.9 MB of empty messages arrive at its gateway (goal:
   100 ms), and the statuses they got;
8. engine process: a core on the HF engine (the model itself) whose engine process is stopped
   (SIGSTOP) with a stream running, then continued, then killed (SIGKILL): seconds to health
   NOT_SERVING and back, seconds from the kill to a new request's success, the statuses
   clients got meanwhile (503, never 500) and the running stream's in-band error.

The scenario functions are the tests' own (tests/reliability/scenarios.py, fuzzing.py); a
section that sees a problem lists it, and the exit status is 1 if any did.

Usage: python scripts/bench/soak.py [--soak-seconds 600] [--model models/demo] [--only abuse]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
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

    def __init__(self, name: str, model: str, port: int, *flags: str, engine: str = "mock"):
        """`engine`: "mock", or "hf" to serve the model itself (its engine in a process of its own)."""
        self.name, self.port = name, port
        self.args = ("--model", model, "--engine", engine, "--model-name", "mock", "--port", str(port))
        # Room for the scenarios' long streams whatever the model's own context length.
        self.args += ("--mock-context-length", "8192") if engine == "mock" else ()
        self.args += ("--log-level", "WARNING", *flags)
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
        await asyncio.wait_for(asyncio.gather(*(first_success(PROBES[n], http, urls[n], since) for n in urls)), 60)


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


# ------------------------------------------------------------------------------ 6-8. abuse


def start_gateway(name: str, core_port: int, *flags: str) -> tuple[Proc, str]:
    """One OpenAI gateway process in front of the core at `core_port`, and its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateways", "openai", "--core", f"127.0.0.1:{core_port}", "--port", str(port)]
    proc = Proc(name, [*cmd, "--log-level", "WARNING", *flags], ready="trellis-gateway")
    return proc, f"http://127.0.0.1:{port}"


JSON = {"Content-Type": "application/json"}


def _chat(tokens: int, stream: bool = True) -> bytes:
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    return json.dumps({**body, "stream": stream, "ignore_eos": True}).encode()


def _post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def slow_reader(url: str, until: float, tokens: int) -> dict[str, int]:
    """Streams read at 1 byte/s, with a 4 KiB receive buffer (so unread output waits in the
    gateway, not in this client's kernel buffer), one after another until `until`: how many the
    gateway ended (cancelled for reading too slowly)."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    body = _chat(tokens)
    out = {"streams": 0, "ended_by_gateway": 0}
    while time.monotonic() < until:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, _post_head("/v1/chat/completions", len(body)) + body)
            out["streams"] += 1
            while time.monotonic() < until:
                if not await loop.sock_recv(sock, 1):
                    out["ended_by_gateway"] += 1
                    break
                await asyncio.sleep(1.0)
        except OSError:
            out["ended_by_gateway"] += 1
        finally:
            sock.close()
    return out


async def slow_readers_section(model: str, port: int, readers: int, seconds: float) -> dict[str, Any]:
    """`readers` slow readers through one OpenAI gateway for `seconds`: the gateway's and the
    core's RSS (every 2 s) against the bound the configured buffers set."""
    core = Core("soak-core-slow", model, port, "--max-batch-size", "64", "--mock-step-ms", "2")
    await core.start()
    gateway, url = start_gateway("soak-gateway-slow", port)
    try:
        await serving({"openai": url})
        gw = gateway.process
        before = {"gateway": gw.memory_info().rss / MIB, "core": core.rss_mib()}
        samples: dict[str, list[float]] = {"gateway": [], "core": []}
        until = time.monotonic() + seconds
        say(f"slow readers: {readers} streams read at 1 byte/s for {seconds:.0f} s")
        tasks = [asyncio.create_task(slow_reader(url, until, 8000)) for _ in range(readers)]
        while time.monotonic() < until:
            samples["gateway"].append(gw.memory_info().rss / MIB)
            samples["core"].append(core.rss_mib())
            await asyncio.sleep(2.0)
        counts = await asyncio.gather(*tasks)
        buffered = 4 * MIB  # the gateway's --max-buffered-bytes default
        out = {
            "readers": readers,
            "seconds": seconds,
            "streams": sum(c["streams"] for c in counts),
            "ended_by_gateway": sum(c["ended_by_gateway"] for c in counts),
            "rss_mib": {
                name: {"before": round(before[name], 1), "max": round(max(v), 1), "last": round(v[-1], 1)}
                for name, v in samples.items()
            },
            "gateway_bound_mib": round(readers * buffered / MIB, 1),
            "max_buffered_bytes": buffered,
        }
        growth = out["rss_mib"]["gateway"]["max"] - out["rss_mib"]["gateway"]["before"]
        out["gateway_growth_mib"] = round(growth, 1)
        out["core_growth_mib"] = round(out["rss_mib"]["core"]["max"] - out["rss_mib"]["core"]["before"], 1)
        out["problems"] = (
            [f"gateway grew {growth:.0f} MiB, over its bound"] if growth > out["gateway_bound_mib"] else []
        )
        return out
    finally:
        gateway.stop()
        await core.stop()


def gzip_bomb(expanded: int) -> bytes:
    """A gzip body of `expanded` zero bytes (about 1/1000 of that on the wire)."""
    zero = bytes(2**20)
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [c.compress(zero) for _ in range(expanded // len(zero))]
    return b"".join([*parts, c.flush()])


def many_messages(size: int) -> bytes:
    """A chat body of empty user messages, just under `size` bytes."""
    n = size // len(b'{"role":"user","content":""},') - 1
    body = {"model": "mock", "messages": [{"role": "user", "content": ""}] * n, "max_tokens": 1}
    return json.dumps(body, separators=(",", ":")).encode()


async def fire(url: str, bombs: int, bodies: int) -> dict[str, list[int]]:
    """Send `bombs` gzip bombs (1 GiB of zeros) and `bodies` many-message bodies (1.9 MB) to the
    OpenAI gateway at `url` at once; their statuses. Run in a process of its own (`abuse_section`),
    so that building and sending them never delays the measuring client."""
    bomb, crowd = gzip_bomb(2**30), many_messages(1_900_000)
    statuses: dict[str, list[int]] = {"bombs": [], "bodies": []}

    async def post(kind: str, http: aiohttp.ClientSession, data: bytes, headers: dict[str, str]) -> None:
        async with http.post(url + "/v1/chat/completions", data=data, headers=headers) as resp:
            await resp.read()
            statuses[kind].append(resp.status)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        print(json.dumps({"ready": True, "bomb_wire_bytes": len(bomb), "body_bytes": len(crowd)}), flush=True)
        sys.stdin.readline()  # the go
        await asyncio.gather(
            *(post("bombs", http, bomb, {**JSON, "Content-Encoding": "gzip"}) for _ in range(bombs)),
            *(post("bodies", http, crowd, JSON) for _ in range(bodies)),
        )
    return statuses


async def abuse_section(model: str, port: int, bombs: int, bodies: int) -> dict[str, Any]:
    """The longest gap between two tokens of a running stream through one OpenAI gateway while
    `bombs` gzip bodies that expand to 1 GiB and `bodies` 1.9 MB chat bodies of empty messages
    arrive at the same gateway (unauthenticated), against the gaps before they came."""
    step_ms = 10.0
    core = Core("soak-core-abuse", model, port, "--max-batch-size", "64", "--mock-step-ms", str(step_ms))
    await core.start()
    gateway, url = start_gateway("soak-gateway-abuse", port)
    code = f"import asyncio, json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import soak; "
    code += f"print(json.dumps(asyncio.run(soak.fire({url!r}, {bombs}, {bodies}))))"
    try:
        await serving({"openai": url})
        arrivals: list[float] = []
        marks: dict[str, float] = {}
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert client.stdin is not None and client.stdout is not None
        sizes = json.loads(await client.stdout.readline())

        async def stream(http: aiohttp.ClientSession) -> None:
            async with http.post(url + "/v1/chat/completions", data=_chat(1500), headers=JSON) as resp:
                async for line in resp.content:
                    if _is_token("openai", line):
                        arrivals.append(time.monotonic())

        async with aiohttp.ClientSession() as http:
            running = asyncio.create_task(stream(http))
            while len(arrivals) < 100:  # a second of steady tokens first
                if running.done():
                    raise RuntimeError(f"abuse: the running stream ended early: {running.exception()}")
                await asyncio.sleep(0.05)
            say(f"abuse: {bombs} gzip bombs and {bodies} many-message bodies during a running stream")
            marks["start"] = time.monotonic()
            client.stdin.write(b"go\n")
            statuses = json.loads(await client.stdout.readline())
            marks["end"] = time.monotonic()
            await client.wait()
            await asyncio.sleep(1.0)
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

        def gaps(lo: float, hi: float) -> list[float]:
            return [b - a for a, b in itertools.pairwise(arrivals) if lo <= b <= hi]

        during, before = gaps(marks["start"], marks["end"] + 0.5), gaps(0, marks["start"])
        longest = max(during, default=0.0)
        out = {
            "bombs": bombs,
            "bomb_wire_bytes": sizes["bomb_wire_bytes"],
            "bomb_expanded_bytes": 2**30,
            "many_message_bodies": bodies,
            "many_message_body_bytes": sizes["body_bytes"],
            "statuses": {k: sorted(v) for k, v in statuses.items()},
            "abuse_seconds": round(marks["end"] - marks["start"], 2),
            "mock_step_ms": step_ms,
            "longest_stall_ms": round(1000 * longest, 1),
            "longest_gap_before_ms": round(1000 * max(before, default=0.0), 1),
            "goal_ms": 100,
        }
        out["problems"] = [f"a running stream stalled {out['longest_stall_ms']} ms"] if longest > 0.1 else []
        out["problems"] += [f"{k}: 5xx answers {v}" for k, v in statuses.items() if any(x >= 500 for x in v)]
        return out
    finally:
        gateway.stop()
        await core.stop()


async def first_of(event: asyncio.Event, task: asyncio.Task[None]) -> None:
    """Wait for `event`; raise if `task` ends first (with its error)."""
    waiter = asyncio.create_task(event.wait())
    await asyncio.wait([waiter, task], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if not event.is_set():
        waiter.cancel()
        raise RuntimeError(f"the stream ended before its first token: {task.exception() if task.done() else 'timeout'}")


def engine_process(core: Core) -> psutil.Process:
    """The core's HF engine process (multiprocessing's spawned child, not its resource tracker)."""
    for child in core.process.children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("the core has no engine process")


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def until_health(address: str, status: int, since: float) -> float:
    """Seconds from `since` until the core's health reports `status` (polled every 20 ms)."""
    while await health_status(address) != status:  # noqa: ASYNC110 (another process's state)
        await asyncio.sleep(0.02)
    return time.monotonic() - since


async def engine_section(model: str, port: int, stall_seconds: float) -> dict[str, Any]:
    """A core on the HF engine (`model` itself) behind an OpenAI gateway: its engine process
    stopped (SIGSTOP) with a stream running, then continued; then killed (SIGKILL) with a
    stream running. Seconds to NOT_SERVING and back, and until a new request succeeds, with the
    statuses clients got meanwhile."""
    flags = ("--engine-stall-seconds", str(stall_seconds), "--max-batch-size", "8")
    core = Core("soak-core-engine", model, port, *flags, engine="hf")
    await core.start()
    gateway, url = start_gateway("soak-gateway-engine", port)
    serving_ = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    out: dict[str, Any] = {"engine_stall_seconds": stall_seconds}
    body = json.dumps({"model": "mock", "prompt": "hi", "max_tokens": 2})
    try:
        await serving({"openai": url})
        async with aiohttp.ClientSession() as http:
            first_token = asyncio.Event()
            ended: list[str] = []

            async def stream() -> None:
                async with http.post(url + "/v1/chat/completions", data=_chat(900), headers=JSON) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"engine: {resp.status} {await resp.text()}")
                    async for line in resp.content:
                        if _is_token("openai", line):
                            first_token.set()
                        if line.startswith(b"data:") and b'"error"' in line:
                            ended.append("in-band error")
                ended.append("ended")

            say("engine: SIGSTOP of the engine process with a stream running")
            running = asyncio.create_task(stream())
            await first_of(first_token, running)
            engine = engine_process(core)
            engine.suspend()
            stopped = time.monotonic()
            # Work pending for sure, whatever the running stream's length.
            waiting = asyncio.create_task(http.post(url + "/v1/completions", data=body, headers=JSON))
            out["stop"] = {"not_serving_after_s": round(await until_health(core.address, not_serving, stopped), 3)}
            engine.resume()
            resumed = time.monotonic()
            out["stop"]["serving_after_continue_s"] = round(await until_health(core.address, serving_, resumed), 3)
            async with await waiting as resp:
                out["stop"]["waiting_request_status"] = resp.status
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

            say("engine: SIGKILL of the engine process with a stream running")
            first_token.clear()
            running = asyncio.create_task(stream())
            await first_of(first_token, running)
            engine.kill()
            killed = time.monotonic()
            statuses: dict[int, int] = {}
            while True:
                async with http.post(url + "/v1/completions", data=body, headers=JSON) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            recovery = time.monotonic() - killed
            await asyncio.wait_for(running, 30)
            out["kill"] = {
                "recovery_s": round(recovery, 3),
                "statuses_meanwhile": {str(k): v for k, v in sorted(statuses.items())},
                "running_stream": ended,
                "new_engine_pid_differs": engine_process(core).pid != engine.pid,
            }
        problems = []
        if any(code >= 500 and code != 503 for code in statuses):
            problems.append(f"engine kill: statuses {statuses}")
        if "in-band error" not in ended:
            problems.append("engine kill: the running stream got no in-band error")
        out["problems"] = problems
        return out
    finally:
        gateway.stop()
        await core.stop()


# ------------------------------------------------------------------------------ run


async def abuse_sections(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Sections 6-8: slow readers, compressed bombs and many-message bodies, the engine process
    stopped and killed; each on a core and an OpenAI gateway of its own."""
    report["slow_readers"] = await slow_readers_section(
        args.model, free_port(), args.slow_readers, args.slow_reader_seconds
    )
    say(f"slow readers: {report['slow_readers']}")
    report["abuse_stall"] = await abuse_section(args.model, free_port(), bombs=8, bodies=4)
    say(f"abuse: {report['abuse_stall']}")
    # Each kind alone, to tell which costs the stall (their problems are the headline's).
    parts = {"bombs_only": (8, 0), "bodies_only": (0, 4)}
    report["abuse_stall"]["parts"] = {
        name: {k: v for k, v in (await abuse_section(args.model, free_port(), *n)).items() if k != "problems"}
        for name, n in parts.items()
    }
    say(f"abuse parts: {report['abuse_stall']['parts']}")
    report["engine_process"] = await engine_section(args.model, free_port(), args.engine_stall_seconds)
    say(f"engine: {report['engine_process']}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.only == "abuse":
        report: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
        await abuse_sections(args, report)
        return report
    port = free_port()
    gateways, urls = start_gateways(port)
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
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
    await abuse_sections(args, report)
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
    if "slow_readers" in report:
        r = report["slow_readers"]
        rss = r["rss_mib"]
        print(
            f"  slow readers: {r['readers']} for {r['seconds']:.0f} s ({r['streams']} streams, "
            f"{r['ended_by_gateway']} ended by the gateway); RSS MiB gateway {rss['gateway']['before']} -> max "
            f"{rss['gateway']['max']} "
            f"(bound +{r['gateway_bound_mib']}), core {rss['core']['before']} -> max {rss['core']['max']}"
        )
    if "abuse_stall" in report:
        r = report["abuse_stall"]
        print(
            f"  abuse: longest stall of a running stream {r['longest_stall_ms']} ms (before: longest gap "
            f"{r['longest_gap_before_ms']} ms; goal {r['goal_ms']} ms) over {r['abuse_seconds']} s; "
            f"statuses {r['statuses']}"
        )
        for name, part in r.get("parts", {}).items():
            print(f"    {name}: longest stall {part['longest_stall_ms']} ms, statuses {part['statuses']}")
    if "engine_process" in report:
        r = report["engine_process"]
        print(
            f"  engine process: SIGSTOP -> NOT_SERVING in {r['stop']['not_serving_after_s']} s, SIGCONT -> SERVING in "
            f"{r['stop']['serving_after_continue_s']} s; SIGKILL -> a new request served in "
            f"{r['kill']['recovery_s']} s "
            f"(statuses meanwhile {r['kill']['statuses_meanwhile']}; running stream {r['kill']['running_stream']})"
        )
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
    p.add_argument("--slow-readers", type=int, default=20, help="streams read at 1 byte/s (section 6)")
    p.add_argument("--slow-reader-seconds", type=float, default=60.0, help="how long they read (section 6)")
    p.add_argument(
        "--engine-stall-seconds", type=float, default=1.0, help="the HF core's watchdog in section 8 (its flag)"
    )
    p.add_argument(
        "--only", choices=["all", "abuse"], default="all", help="abuse: sections 6-8 alone (about 3 minutes)"
    )
    p.add_argument("--output", default=str(ROOT / "bench-results" / "reliability.json"))
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    report["problems"] = [
        f"{section}: {p}"
        for section in (
            "disconnect_storm",
            "fuzz",
            "soak",
            "core_kill",
            "drain",
            "slow_readers",
            "abuse_stall",
            "engine_process",
        )
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
