"""`make bench`: every figure the project reports, measured in one run on this machine.

Starts the core on the demo model and then, one at a time, each gateway and the baseline server
(`transformers serve --continuous-batching` with an explicit small cache), and drives them with
scripts/bench/loadgen.py's closed loop (64 new tokens per request, EOS ignored where the protocol
allows). Comparisons measure each side in a steady-state window (after a warm-up, so neither the
first wave nor the last is in the figures), alternate the two sides over several rounds and use
the median, because the machine is shared and noisy: figures are reported as ratios against a
baseline from this run.

Figures:
  core        output tokens/s at 1, 8 and 32 streams; 32-stream / 1-stream ratio; peak RSS
  static      at 16 and 32 streams, the core (direct gRPC, steady-state window) vs the same model's
              in-process padded static batch of that size (scripts/bench/static_batch.py):
              tokens/s ratio, TTFT and ITL p50 of both, the core's CPU µs per token
  gateways    at 16 streams (steady-state windows; the load generator and the gateway on the
              serving CPUs), gateway vs direct gRPC: tokens/s ratio, added TTFT and ITL p50
  baseline    at 16 streams (steady-state windows), core (gRPC) and the OpenAI gateway vs
              transformers serve: tokens/s ratio and TTFT p50 of both
  websocket   events/s of one ws gateway with 64 sockets x 4 prompts; its CPU share vs the core's
  guided      at 16 streams over gRPC, requests constrained to a JSON schema vs free ones: tokens/s
              ratio (the goal: at least 0.9), with the machine's load average
  lora        at 16 streams over gRPC, requests spread over 4 LoRA adapters (rank 8 on every Linear
              layer, all resident) vs the base model alone: tokens/s ratio (the goal: at least 0.8)
              and, on mock cores (scripts/bench/lora_fleet.py), the share of requests over 6
              adapters that reach a core holding their adapter, 3 cores of 2 slots, with adapter
              affinity (--routing prefix) and round robin (the goal: at least 90 %)
  overhead    on the mock engine (scripts/bench/overhead.py): CPU µs per streamed token of the core
              and of each gateway at 64 and 256 streams, tokens/s, ITL above the step time
  prefix      the HF engine's prefix cache and prefix routing (scripts/bench/prefix.py): a shared
              768-token prefix and 6-turn chats, cache on vs off (TTFT p50, tokens/s); the token
              hit rate of 12 chats over 3 cores with prefix routing, round robin and one core; RSS
              and cache blocks over 10,000 distinct prompts
  fairness    on the mock engine (scripts/bench/fairness.py): a noisy tenant at 10x another's rate
              and 2x capacity (the quiet tenant's p99 TTFT against it alone, Jain's index of the
              tokens by weight), and high-priority requests' p99 TTFT under 2x overload

Sections are merged into bench-results/summary.json: a run of some sections keeps the others.
At the end, scripts/bench/report.py writes the summary's figures into docs/performance.md.

Usage: python scripts/bench/run_all.py --model models/demo [--out bench-results] [--rounds 3]
           [--skip baseline] [--only overhead]
       python scripts/bench/run_all.py --only hf     # the HF engine's goals: static and baseline
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fairness import run_fairness
from loadgen import GrpcClient, LmiClient, OpenAIClient, Result, TritonClient, run_load
from overhead import TARGETS as OVERHEAD_TARGETS
from overhead import _f as num
from overhead import measure as measure_window
from overhead import merge_summary, print_overhead, run_overhead
from procs import ROOT, Proc, free_port
from report import prefix_rows
from report import update as update_report

HF_SECTIONS = {"core", "static", "gateways", "websocket", "baseline", "guided", "lora"}
SECTIONS = ("core", "static", "gateways", "websocket", "baseline", "guided", "lora", "overhead", "prefix", "fairness")
#: The lora section's adapters (made in the output directory: scripts/bench/lora_mixed.py).
LORA_ADAPTERS = ("bench0", "bench1", "bench2", "bench3")
# Names that select several sections.
GROUPS = {"hf": {"static", "baseline"}}

#: The guided section's schema: a list of at least 24 bounded records, so a constrained output is
#: still unfinished after 64 tokens and runs as long as a free one with ignore_eos (greedy both).
GUIDED_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 24,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["name", "qty", "ok"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }
)


def measure(client, concurrency: int, requests: int, label: str, max_new_tokens: int) -> Result:
    result = asyncio.run(
        run_load(client, concurrency, requests, warmup=4, label=label, max_new_tokens=max_new_tokens, progress=False)
    )
    print("  " + result.row(), flush=True)
    return result


#: Warm-up and window of a steady-state measurement, in seconds.
STEADY_WARMUP_S, STEADY_WINDOW_S = 3.0, 8.0


def steady(client, label: str, streams: int = 16, procs: dict[str, Proc] | None = None) -> dict:
    """`streams` closed-loop streams against `client` for a warm-up, then one measured window
    (overhead.measure): every stream finishes several requests inside it, and neither the first
    wave (every stream's prefill at once) nor the last (streams running out) is in the figures,
    which is what a server under steady load sees. With `procs`, their CPU too."""
    run = asyncio.run(
        measure_window(
            client,
            streams,
            warmup_s=STEADY_WARMUP_S,
            window_s=STEADY_WINDOW_S,
            procs=procs or {},
            step_ms=0.0,
            label=label,
        )
    )
    print(
        f"  {label:<18} x{streams:<3} {run['tokens_per_s']:8.0f} tok/s  "
        f"TTFT p50 {num(run['ttft_ms']['p50'], 7, 1)} ms  ITL p50 {num(run['itl_ms']['p50'], 6)} ms  "
        f"errors {run['errors']}",
        flush=True,
    )
    return run


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (of `steady` or static_batch.py results)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def compare(make_a, make_b, label_a: str, label_b: str, rounds: int) -> dict:
    """Alternate steady-state runs of A and B at 16 streams `rounds` times; report both medians,
    the B/A tokens/s ratio and the median added TTFT and ITL p50 of the pairs."""
    a_runs, b_runs = [], []
    for _ in range(rounds):
        a_runs.append(steady(make_a(), label_a))
        b_runs.append(steady(make_b(), label_b))
    a, b = median_run(a_runs), median_run(b_runs)
    pairs = list(zip(a_runs, b_runs, strict=True))
    return {
        label_a: a,
        label_b: b,
        "tokens_per_s_ratio": b["tokens_per_s"] / a["tokens_per_s"],
        "added_ttft_p50_ms": statistics.median(y["ttft_ms"]["p50"] - x["ttft_ms"]["p50"] for x, y in pairs),
        "added_itl_p50_ms": statistics.median(y["itl_ms"]["p50"] - x["itl_ms"]["p50"] for x, y in pairs),
        "rounds": {label_a: [r["tokens_per_s"] for r in a_runs], label_b: [r["tokens_per_s"] for r in b_runs]},
    }


def main() -> int:
    """Run every benchmark; writes bench-results/summary.json and prints a summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="torch threads of the core's HF engine and of the static batch (0: the engine's default)",
    )
    p.add_argument(
        "--core-args",
        default="",
        metavar="FLAGS",
        help="extra flags of the HF core under test, as one string (e.g. --core-args='--no-engine-process')",
    )
    p.add_argument(
        "--core-root",
        default="",
        metavar="DIR",
        help="run the HF core under test from another checkout with its own .venv (a before/after "
        "comparison: e.g. `git worktree add --detach /tmp/before main && make -C /tmp/before venv`)",
    )
    p.add_argument(
        "--skip", default="", help="comma-separated sections to leave out: " + ",".join([*SECTIONS, *GROUPS])
    )
    p.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    p.add_argument(
        "--baseline",
        choices=["none", "vllm"],
        default="none",
        help="prefix section: also compare with vLLM's CPU build (make vllm-venv; skipped when absent)",
    )
    args = p.parse_args()

    def sections(arg: str) -> set[str]:
        names = set(filter(None, arg.split(",")))
        return set().union(*(GROUPS.get(name, {name}) for name in names))

    selected = sections(args.only) or set(SECTIONS)
    selected -= sections(args.skip)
    unknown = selected - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    out = ROOT / args.out
    out.mkdir(exist_ok=True)
    summary: dict = {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count()},
    }
    try:
        if selected & HF_SECTIONS:
            hf_sections(args, selected, out, summary)
        if "lora" in selected:
            from lora_fleet import run_lora_fleet  # imports the core (torch) in this process

            summary["lora_fleet"] = run_lora_fleet(args.model)
        if "overhead" in selected:
            summary["overhead"] = run_overhead(
                args.model, streams=[64, 256], targets=list(OVERHEAD_TARGETS), tokens=args.max_new_tokens
            )
        if "prefix" in selected:
            summary["prefix"] = prefix_section(args, out)
        if "fairness" in selected:
            summary["fairness"] = run_fairness(args.model)
    finally:
        path = merge_summary(out, summary)  # what was measured before a failure is kept
    print_summary(json.loads(path.read_text()))
    doc = ROOT / "docs/performance.md"
    try:
        update_report(path, doc)
    except (OSError, ValueError, KeyError) as e:  # the measurements are in summary.json either way
        print(f"{doc} not updated: {type(e).__name__}: {e}")
    else:
        print(f"wrote the figures into {doc}")
    return 0


def prefix_section(args, out: Path) -> dict:
    """scripts/bench/prefix.py's four parts, in a process of their own (it starts its own
    cores and gateways; its progress lines pass through)."""
    path = out / "prefix.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench/prefix.py"), "--model", args.model, "--json", str(path)]
    subprocess.run([*cmd, "--rounds", str(args.rounds), "--baseline", args.baseline], check=True, cwd=ROOT)
    figures = json.loads(path.read_text())
    figures.pop("setup", None)
    return dict(figures)


def hf_sections(args, selected: set[str], out: Path, summary: dict) -> None:
    """The sections measured on the HF engine and the demo model, against one core."""
    n = args.max_new_tokens
    py = sys.executable
    threads = args.engine_threads
    if threads == 0:
        sys.path.insert(0, str(ROOT))
        from core.engine.hf_config import default_threads

        threads = default_threads(0)
    core_port = free_port()
    core_addr = f"127.0.0.1:{core_port}"
    core_root = Path(args.core_root).resolve() if args.core_root else ROOT
    lora_args: list[str] = []
    if "lora" in selected:
        from lora_mixed import make_adapters

        made = make_adapters(str(ROOT / args.model), len(LORA_ADAPTERS), 8, out / "lora-adapters")
        modules = ",".join(f"{name}={path}" for name, path in zip(LORA_ADAPTERS, made, strict=True))
        lora_args = ["--lora-modules", modules, "--max-loras", str(len(LORA_ADAPTERS))]
    core = Proc(
        "core",
        [
            str(core_root / ".venv/bin/python") if args.core_root else py,
            "-m",
            "core",
            "--model",
            str(ROOT / args.model),
            "--port",
            str(core_port),
            "--model-name",
            "demo",
            "--log-level",
            "WARNING",
            *(["--threads", str(args.engine_threads)] if args.engine_threads else []),
            *lora_args,
            *shlex.split(args.core_args),
        ],
        ready="serving",
        cwd=core_root,
    )
    try:
        if "core" in selected:
            print("== core: tokens/s at 1, 8 and 32 streams", flush=True)
            runs = {
                c: measure(GrpcClient(core_addr, n, chat=False), c, max(24, 4 * c), f"grpc c={c}", n)
                for c in (1, 8, 32)
            }
            summary["core"] = {
                "tokens_per_s": {str(c): r.output_tokens_per_s for c, r in runs.items()},
                "ratio_32_vs_1": runs[32].output_tokens_per_s / runs[1].output_tokens_per_s,
                "runs": {str(c): asdict(r) for c, r in runs.items()},
            }
        if "static" in selected:
            summary["static"] = static_batch(core, core_addr, args, n, threads)
        if "gateways" in selected:
            summary["gateways"] = gateways_vs_grpc(core_addr, args, n, threads)
        if "websocket" in selected and (ROOT / "scripts/bench/ws_events.py").exists():
            port = free_port()
            gw = Proc(
                "gateway-ws",
                [py, "-m", "gateways", "ws", "--core", core_addr, "--port", str(port), "--log-level", "WARNING"],
                ready="trellis-gateway",
            )
            try:
                print("== websocket gateway: events/s with 64 sockets x 4 prompts", flush=True)
                ws_json = out / "ws_events.json"
                subprocess.run(
                    [
                        py,
                        "scripts/bench/ws_events.py",
                        "--url",
                        f"ws://127.0.0.1:{port}/ws",
                        "--core-pid",
                        str(core.popen.pid),
                        "--gateway-pid",
                        str(gw.popen.pid),
                        "--json-out",
                        str(ws_json),
                    ],
                    check=True,
                    cwd=ROOT,
                )
                summary["websocket"] = json.loads(ws_json.read_text())
            finally:
                gw.stop()
        if "guided" in selected:
            summary["guided"] = guided(core, core_addr, args, n)
        if "baseline" in selected:
            summary["baseline"] = baseline(core_addr, args, out, n)
        if "lora" in selected:
            print("== lora: 16 streams over 4 adapters vs the base model alone (gRPC)", flush=True)
            summary["lora"] = compare(
                lambda: GrpcClient(core_addr, n, chat=False),
                lambda: GrpcClient(core_addr, n, chat=False, adapters=LORA_ADAPTERS),
                "base",
                "adapters",
                args.rounds,
            )
        summary["core_peak_rss_mb"] = core.peak_rss_mb()
        summary["engine_process_peak_rss_mb"] = EngineProcess(core).peak_rss_mb()
    finally:
        core.stop()


def gateways_vs_grpc(core_addr: str, args, n: int, threads: int) -> dict:
    """Each HTTP gateway against direct gRPC at 16 streams (`compare`), one gateway process at a
    time; the load generator and the gateway run on the serving CPUs, leaving the engine process
    its CPU on both sides."""
    py = sys.executable
    result: dict = {}
    with on_serving_cpus(threads):
        for name, cls, chat in (
            ("lmi", LmiClient, False),
            ("openai", OpenAIClient, True),
            ("triton", TritonClient, False),
        ):
            port = free_port()
            cmd = [py, "-m", "gateways", name, "--core", core_addr, "--port", str(port), "--log-level", "WARNING"]
            gw = Proc(f"gateway-{name}", cmd, ready="trellis-gateway")
            try:
                print(f"== {name} gateway vs direct gRPC at 16 streams", flush=True)
                result[name] = compare(
                    lambda chat=chat: GrpcClient(core_addr, n, chat=chat),
                    lambda cls=cls, port=port: cls(f"http://127.0.0.1:{port}", n, "demo"),
                    "grpc",
                    name,
                    args.rounds,
                )
            finally:
                gw.stop()
    return result


def guided(core: Proc, core_addr: str, args, n: int) -> dict:
    """Requests constrained to GUIDED_SCHEMA vs free ones (greedy, 64 tokens each, 16 streams
    over gRPC), alternated over at least 5 rounds. Besides tokens/s, the core's own CPU seconds
    per generated token (psutil, warm-up requests included on both sides), which other work on
    the machine disturbs far less; both as the median of the rounds' ratios."""
    rounds = max(args.rounds, 5)
    runs: dict[str, list[Result]] = {"free": [], "constrained": []}
    cpu_us: dict[str, list[float]] = {"free": [], "constrained": []}
    load = [os.getloadavg()[0]]
    print(f"== guided decoding: JSON-schema-constrained vs free requests at 16 streams (gRPC), {rounds} rounds")
    for _ in range(rounds):
        for label, schema in (("free", None), ("constrained", GUIDED_SCHEMA)):
            before = core.cpu_seconds()
            result = measure(GrpcClient(core_addr, n, chat=False, json_schema=schema), 16, 48, label, n)
            tokens = result.output_tokens + 4 * n  # measure()'s 4 warm-up requests generate n tokens each
            cpu_us[label].append((core.cpu_seconds() - before) * 1e6 / tokens)
            runs[label].append(result)
        load.append(os.getloadavg()[0])
    pairs = list(zip(runs["free"], runs["constrained"], strict=True))
    return {
        "rounds": rounds,
        "tokens_per_s_ratio": statistics.median(c.output_tokens_per_s / f.output_tokens_per_s for f, c in pairs),
        "core_cpu_us_per_token": {k: statistics.median(v) for k, v in cpu_us.items()},
        "core_cpu_per_token_ratio": statistics.median(
            c / f for f, c in zip(cpu_us["free"], cpu_us["constrained"], strict=True)
        ),
        "added_itl_p50_ms": statistics.median(c.itl_ms["p50"] - f.itl_ms["p50"] for f, c in pairs),
        "load_average_1m": load,
        "runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
    }


class EngineProcess:
    """CPU and memory accounting of the processes a core started (the HF engine process), in
    the shape overhead.measure takes for its `procs`."""

    def __init__(self, core: Proc):
        self.core = psutil.Process(core.pid)

    def children(self) -> list[psutil.Process]:
        return self.core.children(recursive=True)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the core's children have used so far."""
        return self._seconds(lambda t: t.user + t.system)

    def system_seconds(self) -> float:
        """The kernel's part of `cpu_seconds`."""
        return self._seconds(lambda t: t.system)

    def _seconds(self, part) -> float:
        total = 0.0
        for child in self.children():
            with contextlib.suppress(psutil.Error):
                total += part(child.cpu_times())
        return total

    def peak_rss_mb(self) -> float:
        """The largest peak resident set size (VmHWM) among the core's children, in MiB."""
        peaks = [0.0]
        for child in self.children():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks.append(int(line.split()[1]) / 1024)
        return max(peaks)


def static_batch(core: Proc, core_addr: str, args, n: int, threads: int, streams=(16, 32)) -> dict:
    """The core (direct gRPC, closed loop, one steady-state window after a warm-up) vs the same
    model's in-process padded static batch of the same size with the same torch threads (a
    fresh process each round, so the core sits idle meanwhile), alternating over `args.rounds`
    rounds; medians of each side. The core's CPU is split into the core process (serving:
    pipeline, gRPC) and its engine process, per streamed token.

    Where the machine has more CPUs than the engine has threads, both sides run their model on
    the CPUs the core's engine process takes by default (`--engine-cpus auto`): the static batch
    is started there, and the load generator (this process: a stand-in for clients elsewhere)
    runs on the others, the serving CPUs, during the whole section."""
    result: dict = {"threads": threads, "streams": {}}
    with on_serving_cpus(threads) as placement:
        cpus = ""
        if placement is not None:
            cpus = ",".join(map(str, sorted(placement[0])))
            result["cpus"] = {"model": sorted(placement[0]), "load_generator": sorted(placement[1])}
            print(f"   static batch on CPUs {cpus}, load generator on {sorted(placement[1])}", flush=True)
        _static_rounds(core, core_addr, args, n, threads, streams, cpus, result)
    return result


@contextlib.contextmanager
def on_serving_cpus(threads: int) -> Iterator[tuple[frozenset[int], frozenset[int]] | None]:
    """Run this process (the load generator, a stand-in for clients on other machines) and every
    process it starts meanwhile on the serving CPUs, the ones the core's engine process leaves to
    the serving threads by default (`--engine-cpus auto`), so that neither takes the engine's
    CPU, as a deployment that reserves the engine's cores arranges; yields the placement (engine
    CPUs, serving CPUs), or None where the engine takes every CPU (nothing is pinned then).
    Linux: children inherit the affinity of the thread that starts them."""
    sys.path.insert(0, str(ROOT))
    from core.engine.hf_config import engine_cpus
    from core.engine.hf_process import pin_threads

    placement = engine_cpus("auto", threads)
    unpin = pin_threads(placement[1]) if placement is not None else None
    try:
        yield placement
    finally:
        if unpin is not None:
            unpin()


def _static_rounds(core: Proc, core_addr: str, args, n: int, threads: int, streams, cpus: str, result: dict) -> None:
    procs = {"core": core, "engine": EngineProcess(core)}
    for c in streams:
        print(f"== core vs in-process padded static batch at {c} streams ({threads} torch threads)", flush=True)
        core_runs, static_runs = [], []
        for _ in range(args.rounds):
            run = steady(GrpcClient(core_addr, n, chat=False), "core (grpc)", c, procs)
            us = run["cpu_us_per_token"]
            print(
                f"    CPU µs/token: core {us['core']:.0f}, engine process {us['engine']:.0f}, client "
                f"{us['client']:.0f}  others {run['cpu_cores']['others']:.2f} cores",
                flush=True,
            )
            core_runs.append(run)
            static_runs.append(run_static(args.model, c, n, threads, cpus))
        core_med = median_run(core_runs)
        static_med = median_run(static_runs)
        result["streams"][str(c)] = {
            "core": core_med,
            "static": static_med,
            "tokens_per_s_ratio": core_med["tokens_per_s"] / static_med["tokens_per_s"],
            "ttft_p50_ms": {"core": core_med["ttft_ms"]["p50"], "static": static_med["ttft_ms"]["p50"]},
            "rounds": {
                "core_tokens_per_s": [r["tokens_per_s"] for r in core_runs],
                "static_tokens_per_s": [r["tokens_per_s"] for r in static_runs],
                "core_others_cores": [r["cpu_cores"]["others"] for r in core_runs],
                "static_others_cores": [r["others_cores"] for r in static_runs],
            },
        }


def run_static(model: str, batch: int, n: int, threads: int, cpus: str = "") -> dict:
    """One scripts/bench/static_batch.py measurement in a fresh process (on `cpus` if given)."""
    cmd = [sys.executable, "scripts/bench/static_batch.py", "--model", model, "--batch", str(batch)]
    cmd += ["--max-new-tokens", str(n), "--threads", str(threads)]
    cmd += ["--cpus", cpus] if cpus else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"  static   x{batch:<3} {result['tokens_per_s']:8.0f} tok/s  TTFT p50 {result['ttft_ms']['p50']:7.1f} ms  "
        f"ITL p50 {result['itl_ms']['p50']:6.2f} ms  others {result['others_cores']:.2f} cores",
        flush=True,
    )
    return result


def baseline(core_addr: str, args, out: Path, n: int) -> dict:
    """Ours (core over gRPC, and the OpenAI gateway) vs transformers serve --continuous-batching."""
    py = sys.executable
    serve_port, gw_port = free_port(), free_port()
    cache = out / "hf-cache"
    cache.mkdir(exist_ok=True)
    serve_cmd = [
        str(Path(py).parent / "transformers"),  # this environment's CLI, whether or not it is on PATH
        "serve",
        str(ROOT / args.model),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(serve_port),
        "--continuous-batching",
        "--cb-num-blocks",
        "128",
        "--cb-block-size",
        "64",
        "--cb-max-batch-tokens",
        "2048",
    ]
    serve_env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}

    class ServeClient(OpenAIClient):
        ignore_eos = False  # transformers serve rejects the field

    def run_serve() -> dict:
        serve = Proc("transformers-serve", serve_cmd, ready="Uvicorn running", env=serve_env)
        try:
            return steady(
                ServeClient(f"http://127.0.0.1:{serve_port}", n, str(ROOT / args.model)), "transformers serve"
            )
        finally:
            serve.stop()

    gw = None
    results: dict[str, list[dict]] = {"grpc": [], "openai": [], "serve": []}
    print("== baseline: transformers serve --continuous-batching at 16 streams", flush=True)
    for _ in range(args.rounds):
        results["serve"].append(run_serve())
        gw = Proc(
            "gateway-openai-baseline",
            [py, "-m", "gateways", "openai", "--core", core_addr, "--port", str(gw_port), "--log-level", "WARNING"],
            ready="trellis-gateway",
        )
        try:
            results["grpc"].append(steady(GrpcClient(core_addr, n, chat=True), "grpc (chat)"))
            results["openai"].append(steady(OpenAIClient(f"http://127.0.0.1:{gw_port}", n, "demo"), "openai gateway"))
        finally:
            gw.stop()
    med = {k: median_run(v) for k, v in results.items()}
    theirs = med["serve"]["tokens_per_s"]
    return {
        "runs": med,
        "core_vs_serve_tokens_per_s_ratio": med["grpc"]["tokens_per_s"] / theirs,
        "openai_gateway_vs_serve_tokens_per_s_ratio": med["openai"]["tokens_per_s"] / theirs,
        "ttft_p50_ms": {k: v["ttft_ms"]["p50"] for k, v in med.items()},
        "rounds": {k: [r["tokens_per_s"] for r in v] for k, v in results.items()},
    }


def print_summary(s: dict) -> None:
    print("\n==== summary ====")
    if "core" in s:
        t = s["core"]["tokens_per_s"]
        print(
            f"core tokens/s: 1 stream {t['1']:.0f}, 8 streams {t['8']:.0f}, 32 streams {t['32']:.0f}; "
            f"32/1 = {s['core']['ratio_32_vs_1']:.1f}x"
        )
    static = s.get("static", {})
    for c, r in static.get("streams", {}).items():
        us = r["core"]["cpu_us_per_token"]
        print(
            f"core vs in-process padded static batch at {c} streams ({static['threads']} torch threads): "
            f"{r['core']['tokens_per_s']:.0f} vs {r['static']['tokens_per_s']:.0f} tok/s = "
            f"{r['tokens_per_s_ratio']:.2f}x; TTFT p50 {num(r['ttft_p50_ms']['core'], 0, 1)} vs "
            f"{r['ttft_p50_ms']['static']:.1f} ms; CPU µs/token: core {us['core']:.0f}, "
            f"engine process {us['engine']:.0f}"
        )
    for name, g in s.get("gateways", {}).items():
        print(
            f"{name} gateway vs gRPC at 16 streams: tokens/s ratio {g['tokens_per_s_ratio']:.3f}, "
            f"added TTFT p50 {g['added_ttft_p50_ms']:+.2f} ms, added ITL p50 {g['added_itl_p50_ms']:+.2f} ms"
        )
    if "websocket" in s:
        w = s["websocket"]
        print(
            f"websocket: {w['events_per_s']:.0f} events/s; gateway CPU / core CPU "
            f"{w['cpu_share']['gateway_over_core']:.3f}"
        )
    if "baseline" in s:
        b = s["baseline"]
        print(
            f"vs transformers serve at 16 streams: core {b['core_vs_serve_tokens_per_s_ratio']:.2f}x, "
            f"openai gateway {b['openai_gateway_vs_serve_tokens_per_s_ratio']:.2f}x; TTFT p50 ms "
            + ", ".join(f"{k} {v:.1f}" for k, v in b["ttft_p50_ms"].items())
        )
    if "guided" in s:
        g = s["guided"]
        cpu = g["core_cpu_us_per_token"]
        print(
            f"guided decoding at 16 streams: constrained / free tokens/s {g['tokens_per_s_ratio']:.3f} "
            f"(goal >= 0.90); core CPU per token {cpu['constrained']:.0f} vs {cpu['free']:.0f} µs "
            f"= {g['core_cpu_per_token_ratio']:.3f}x; added ITL p50 {g['added_itl_p50_ms']:+.2f} ms"
        )
    if "core_peak_rss_mb" in s:
        print(
            f"core peak RSS: {s['core_peak_rss_mb']:.0f} MiB; its engine process: "
            f"{s.get('engine_process_peak_rss_mb', 0):.0f} MiB"
        )
    if "overhead" in s:
        print_overhead(s["overhead"])
    for what, figure in prefix_rows(s):
        print(f"{what}: {figure}")


if __name__ == "__main__":
    sys.exit(main())
