"""`make bench` section `fairness`: tenant fair shares and request priority on the mock engine.

Open-loop load (Poisson arrivals, so a slow server does not slow the clients down as a closed
loop would) over gRPC `Generate` to a mock core (`--mock-step-ms 50`, batch 32, EOS never
drawn). Every request asks for a uniform 4 to 12 new tokens (seeded), so requests end at
different steps and slots free up every step, as with real output lengths. The core's capacity
is then batch / mean tokens = 4 requests per step (80 requests/s, 640 tokens/s).

Scenarios (each on a fresh core, `--duration` seconds of arrivals, figures over the arrivals
after `--warmup` seconds; a request still waiting for its first token when arrivals end is
cancelled and counts with the time it waited, a lower bound of its TTFT, in the client's
figures; the core's figures (Timing) leave it out):
  b_alone       tenant B alone at its rate (2x capacity / 11): B's TTFT reference.
  noisy         tenant A at 10x B's rate, together 2x capacity: B's TTFT against b_alone
                (goal: p99 <= 1.5x), and the tokens each tenant got, as Jain's fairness index
                of throughput over the weighted max-min fair share (goal: >= 0.9).
  noisy_no_tenant  the same load with no tenant names (first come, first served): what the
                fair share saves B from.
  weighted      A (weight 3) and B (weight 1) each at 1.5x capacity: both backlogged, so the
                tokens should split 3:1 (Jain's index of throughput / weight).
  priority_idle  high-priority requests (priority -1) alone at 10% of capacity: the idle
                core's TTFT.
  priority      the same high-priority requests plus priority-0 load at 2x capacity,
                `--scheduling-policy priority` (goal: high-priority p99 TTFT <= 2x idle).
  noisy_no_preemption, priority_no_preemption  noisy and priority with `--no-preemption`:
                what preempting running requests (core.scheduling) buys, and what it costs in
                throughput.
  noisy_replay  the noisy arrivals replayed step by step through core.scheduling.WaitingQueue
                alone, with and without preemption: each tenant's wait for admission in steps,
                the scheduler's part of TTFT without the host's.

Jain's index J(x) = (sum x)^2 / (n sum x^2) (Jain, Chiu and Hawe, DEC-TR-301, 1984), with x_i a
tenant's token throughput over its weighted max-min fair share of the measured capacity (a
tenant asking less than its share is entitled to what it asks): 1 is perfectly fair.

Usage: python scripts/bench/fairness.py [--model models/demo] [--duration 30] [--out bench-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import ROOT, Proc, free_port

STEP_MS = 50.0
BATCH = 32
TOKENS = (4, 12)  # new tokens per request, uniform, inclusive
MEAN_TOKENS = sum(TOKENS) / 2
CAPACITY_RPS = BATCH / MEAN_TOKENS / (STEP_MS / 1000.0)


@dataclass
class Stream:
    """One tenant's open-loop arrivals."""

    name: str
    rate: float  # requests per second
    tenant: str = ""
    priority: int = 0


@dataclass
class Outcome:
    """What one stream's requests measured inside the window."""

    ttft: list[float] = field(default_factory=list)  # seconds, requests that arrived in the window
    # the core's own view of the same requests (Timing.queue_ms + prefill_ms): the scheduler's
    # part, without the client's and the host's delays
    core_ttft: list[float] = field(default_factory=list)
    tokens: int = 0  # tokens received inside the window
    unfinished: int = 0  # requests of the window cancelled before their first token (no core figure)
    refused: int = 0


def start_core(model: str, *extra: str) -> tuple[Proc, int]:
    port = free_port()
    return Proc(
        "core-fairness",
        [
            sys.executable,
            "-m",
            "core",
            *("--engine", "mock", "--model", model, "--model-name", "demo", "--port", str(port)),
            *("--mock-step-ms", str(STEP_MS), "--mock-eos-probability", "0"),
            *("--max-batch-size", str(BATCH), "--max-queue-size", "100000"),
            *("--log-level", "WARNING", *extra),
        ],
        ready="serving",
    ), port


async def drive(address: str, streams: list[Stream], duration: float, warmup: float, seed: int) -> dict[str, Outcome]:
    """Run the streams' arrivals for `duration` s; wait for every request to end."""
    import grpc
    from trellis.generate.v1 import generate_pb2 as pb
    from trellis.generate.v1 import generate_service_pb2 as spb
    from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

    outcomes = {s.name: Outcome() for s in streams}
    rng = random.Random(seed)
    t0 = time.monotonic()
    window = (t0 + warmup, t0 + duration)
    tasks: set[asyncio.Task[None]] = set()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)

        async def one(s: Stream, tokens: int) -> None:
            out = outcomes[s.name]
            req = spb.GenerateRequest(
                text="Once upon a time",
                stopping=pb.StoppingParams(max_new_tokens=tokens, ignore_eos=True),
                tenant=s.tenant,
                priority=s.priority,
            )
            sent = time.monotonic()
            first = None
            try:
                async for msg in stub.Generate(req):
                    if not msg.outputs:
                        continue
                    now = time.monotonic()
                    if first is None:
                        first = now
                        if window[0] <= sent < window[1]:
                            out.ttft.append(now - sent)
                    if window[0] <= now < window[1]:
                        out.tokens += sum(len(o.tokens) for o in msg.outputs)
                    if msg.HasField("usage") and window[0] <= sent < window[1]:
                        out.core_ttft.append((msg.timing.queue_ms + msg.timing.prefill_ms) / 1000.0)
            except grpc.aio.AioRpcError:
                out.refused += 1
            except asyncio.CancelledError:
                # still waiting when the run ends: its TTFT is at least this long
                if first is None and window[0] <= sent < window[1]:
                    out.ttft.append(time.monotonic() - sent)
                    out.unfinished += 1
                raise

        async def arrivals(s: Stream) -> None:
            r = random.Random(rng.random())
            t = time.monotonic()
            while True:
                t += r.expovariate(s.rate)
                if t >= t0 + duration:
                    return
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                task = asyncio.create_task(one(s, r.randint(*TOKENS)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        await asyncio.gather(*(arrivals(s) for s in streams))
        # Requests still waiting when arrivals end are cancelled (their TTFT counts as at
        # least the time they waited): the backlog of an overloaded stream would take as long
        # again to drain.
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) in ms; nan for none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return 1000.0 * s[min(len(s) - 1, max(0, round(q / 100.0 * len(s)) - 1))]


def jain(xs: list[float]) -> float:
    """Jain's fairness index of `xs` (1: all equal)."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


def fair_shares(capacity: float, demands: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity` (progressive filling): a tenant that asks for
    less than its weighted share gets what it asks, the rest is split by weight among others."""
    shares: dict[str, float] = {}
    left, active = capacity, dict(demands)
    while active:
        unit = left / sum(weights[t] for t in active)
        small = {t: d for t, d in active.items() if d <= unit * weights[t]}
        if not small:
            shares.update({t: unit * weights[t] for t in active})
            break
        for t, d in small.items():
            shares[t] = d
            left -= d
            del active[t]
    return shares


def summarize(outcomes: dict[str, Outcome], streams: list[Stream], window_s: float, weights: dict[str, float]):
    """Per stream TTFT percentiles and tokens/s; Jain's index over max-min fair shares."""
    per: dict[str, Any] = {}
    for s in streams:
        o = outcomes[s.name]
        per[s.name] = {
            "rate_rps": round(s.rate, 2),
            "requests": len(o.ttft),
            "ttft_p50_ms": round(pct(o.ttft, 50), 1),
            "ttft_p99_ms": round(pct(o.ttft, 99), 1),
            "core_ttft_p50_ms": round(pct(o.core_ttft, 50), 1),
            "core_ttft_p99_ms": round(pct(o.core_ttft, 99), 1),
            "tokens_per_s": round(o.tokens / window_s, 1),
            "refused": o.refused,
            "unfinished": o.unfinished,
        }
    served = sum(outcomes[s.name].tokens for s in streams) / window_s
    demands = {s.name: s.rate * MEAN_TOKENS for s in streams}
    shares = fair_shares(served, demands, {s.name: weights.get(s.name, 1.0) for s in streams})
    ratios = [outcomes[s.name].tokens / window_s / shares[s.name] for s in streams]
    return {"streams": per, "tokens_per_s": round(served, 1), "jain": round(jain(ratios), 3)}


def replay_noisy(steps: int = 4000, seed: int = 3, preemption: bool = True) -> dict[str, Any]:
    """The noisy scenario at step level through core.scheduling.WaitingQueue alone (no host, no
    gRPC): Poisson arrivals per step, the batch refilled at every boundary, preempting as the
    mock engine does when `preemption`. Returns each tenant's wait from arrival to its first
    admission in steps (p50, p99), after 500 steps of warm-up, and the preemptions per step."""
    sys.path.insert(0, str(ROOT))
    from core.scheduling import MAX_PREEMPTIONS_PER_STEP, Running, WaitingQueue

    @dataclass
    class Req:
        name: str
        at: int
        left: int  # tokens still to generate
        seq: int = 0
        admitted: bool = False

    q: WaitingQueue[Req] = WaitingQueue()
    rng = random.Random(seed)
    per_step = 2 * BATCH / MEAN_TOKENS
    rates = {"A": per_step * 10 / 11, "B": per_step / 11}
    running: list[Req] = []
    waits: dict[str, list[int]] = {"A": [], "B": []}
    preemptions = 0
    for step in range(steps):
        for name, rate in rates.items():
            t = rng.expovariate(rate)
            while t < 1.0:
                n = rng.randint(*TOKENS)
                r = Req(name, step, n)
                r.seq = q.push(r, cost=n, tenant=name)
                t += rng.expovariate(rate)
        for r in running:
            r.left -= 1
        running = [r for r in running if r.left > 0]
        budget = MAX_PREEMPTIONS_PER_STEP if preemption else 0
        while q:
            if len(running) >= BATCH:
                victims = q.preemption_victims(
                    [Running(0, r.name, 1, r.seq) for r in running],
                    head_rows=1,
                    free_rows=0,
                    batch_rows=BATCH,
                    limit=budget,
                )
                if not victims:
                    break
                budget -= len(victims)
                preemptions += len(victims) if step >= 500 else 0
                for i in victims:
                    q.push(running[i], cost=0, tenant=running[i].name, seq=running[i].seq)
                running = [r for i, r in enumerate(running) if i not in victims]
                continue
            r = q.pop()
            running.append(r)
            if step >= 500 and not r.admitted:
                waits[r.name].append(step - r.at)
            r.admitted = True
    out: dict[str, Any] = {}
    for name, v in waits.items():
        v.sort()
        out[name] = {"wait_p50_steps": v[len(v) // 2], "wait_p99_steps": v[int(len(v) * 0.99)]}
    out["preemptions_per_step"] = round(preemptions / (steps - 500), 3)
    return out


def scenario(model: str, name: str, streams: list[Stream], args, core_flags: tuple[str, ...] = (), weights=None):
    print(f"== fairness: {name} ({args.duration:.0f} s)", flush=True)
    core, port = start_core(model, *core_flags)
    try:
        outcomes = asyncio.run(drive(f"127.0.0.1:{port}", streams, args.duration, args.warmup, seed=7))
    finally:
        core.stop()
    result = summarize(outcomes, streams, args.duration - args.warmup, weights or {})
    print("  " + json.dumps(result), flush=True)
    return result


def run_fairness(model: str, duration: float = 30.0, warmup: float = 5.0) -> dict[str, Any]:
    """Every scenario, and the tracing figure (overhead.run_tracing); returns the "fairness"
    section of summary.json."""
    from overhead import run_tracing

    args = argparse.Namespace(duration=duration, warmup=warmup)
    total = 2 * CAPACITY_RPS
    b_rate, a_rate = total / 11, 10 * total / 11
    runs: dict[str, Any] = {}
    runs["b_alone"] = scenario(model, "b_alone", [Stream("B", b_rate, "b")], args)
    runs["noisy"] = scenario(model, "noisy", [Stream("A", a_rate, "a"), Stream("B", b_rate, "b")], args)
    runs["noisy_no_tenant"] = scenario(model, "noisy_no_tenant", [Stream("A", a_rate), Stream("B", b_rate)], args)
    runs["weighted"] = scenario(
        model,
        "weighted",
        [Stream("A", 1.5 * CAPACITY_RPS, "a"), Stream("B", 1.5 * CAPACITY_RPS, "b")],
        args,
        ("--tenant-weight", "a=3"),
        weights={"A": 3.0},
    )
    high = Stream("high", 0.1 * CAPACITY_RPS, priority=-1)
    runs["priority_idle"] = scenario(model, "priority_idle", [high], args, ("--scheduling-policy", "priority"))
    runs["priority"] = scenario(
        model,
        "priority",
        [high, Stream("load", total)],
        args,
        ("--scheduling-policy", "priority"),
    )
    runs["noisy_no_preemption"] = scenario(
        model, "noisy_no_preemption", [Stream("A", a_rate, "a"), Stream("B", b_rate, "b")], args, ("--no-preemption",)
    )
    runs["priority_no_preemption"] = scenario(
        model,
        "priority_no_preemption",
        [high, Stream("load", total)],
        args,
        ("--scheduling-policy", "priority", "--no-preemption"),
    )
    runs["noisy_replay"] = replay_noisy()
    runs["noisy_replay_no_preemption"] = replay_noisy(preemption=False)
    b_alone, noisy = runs["b_alone"]["streams"]["B"], runs["noisy"]["streams"]["B"]
    idle, loaded = runs["priority_idle"]["streams"]["high"], runs["priority"]["streams"]["high"]
    goals = {
        "noisy_b_p99_ratio": round(noisy["ttft_p99_ms"] / b_alone["ttft_p99_ms"], 2),
        "noisy_b_core_p99_ratio": round(noisy["core_ttft_p99_ms"] / b_alone["core_ttft_p99_ms"], 2),
        "noisy_b_p99_goal": 1.5,
        "noisy_jain": runs["noisy"]["jain"],
        "weighted_jain": runs["weighted"]["jain"],
        "jain_goal": 0.9,
        "priority_p99_ratio": round(loaded["ttft_p99_ms"] / idle["ttft_p99_ms"], 2),
        "priority_core_p99_ratio": round(loaded["core_ttft_p99_ms"] / idle["core_ttft_p99_ms"], 2),
        "priority_p99_goal": 2.0,
        "no_preemption": {
            "noisy_b_p99_ratio": round(
                runs["noisy_no_preemption"]["streams"]["B"]["ttft_p99_ms"] / b_alone["ttft_p99_ms"], 2
            ),
            "noisy_b_core_p99_ratio": round(
                runs["noisy_no_preemption"]["streams"]["B"]["core_ttft_p99_ms"] / b_alone["core_ttft_p99_ms"], 2
            ),
            "noisy_jain": runs["noisy_no_preemption"]["jain"],
            "priority_p99_ratio": round(
                runs["priority_no_preemption"]["streams"]["high"]["ttft_p99_ms"] / idle["ttft_p99_ms"], 2
            ),
            "priority_core_p99_ratio": round(
                runs["priority_no_preemption"]["streams"]["high"]["core_ttft_p99_ms"] / idle["core_ttft_p99_ms"], 2
            ),
        },
        "tokens_per_s": {
            name: runs[name]["tokens_per_s"]
            for name in ("noisy", "noisy_no_preemption", "priority", "priority_no_preemption")
        },
    }
    return {
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "engine": "mock",
            "step_ms": STEP_MS,
            "max_batch_size": BATCH,
            "new_tokens": list(TOKENS),
            "capacity_rps": CAPACITY_RPS,
            "duration_s": duration,
            "warmup_s": warmup,
        },
        "runs": runs,
        "goals": goals,
        # OpenTelemetry tracing off against on (ratio 0.1) on the mock engine, through the
        # OpenAI gateway: tokens/s and CPU per streamed token (scripts/bench/overhead.py).
        "tracing": run_tracing(model),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo", help="tokenizer (or model) directory of the mock core")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per scenario")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of arrivals left out of the figures")
    args = p.parse_args(argv)
    from overhead import merge_summary

    section = run_fairness(args.model, args.duration, args.warmup)
    path = merge_summary(ROOT / args.out, {"fairness": section})
    print(json.dumps(section["goals"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
