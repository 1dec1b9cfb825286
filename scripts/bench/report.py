#!/usr/bin/env python
"""Writes the figures of bench-results/summary.json into docs/performance.md.

The document's figures section lies between two marker comments, FIGURES_BEGIN and FIGURES_END;
this script replaces what is between them with a table rendered from the summary (the date and
the machine's CPU count, never a commit), and keeps the rest of the document, the method written
by hand, as it is. A section missing from the summary leaves its rows out. `make bench`
(scripts/bench/run_all.py) runs it at the end of every run; by hand:

    python scripts/bench/report.py [--summary bench-results/summary.json] [--doc docs/performance.md]

The summary's shape is run_all.py's (sections "core", "static", "gateways", "baseline",
"websocket", "guided", "overhead", "prefix", "lora", "lora_fleet", "fairness", "core_peak_rss_mb",
...) and overhead.py's for "overhead".
Only the standard library is used, so the unit tests import this module without the bench
dependencies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIGURES_BEGIN = "<!-- figures:begin -->"
FIGURES_END = "<!-- figures:end -->"

#: The HTTP gateways compared with direct gRPC, in the order the table lists them.
GATEWAYS = {"lmi": "LMI", "openai": "OpenAI", "triton": "Triton"}
#: Every gateway of the overhead section, in table order.
OVERHEAD_GATEWAYS = {**GATEWAYS, "ws": "WebSocket"}

Row = tuple[str, str]
Summary = Mapping[str, Any]


def num(value: float, digits: int = 0) -> str:
    """`value` with `digits` decimals and thousands separators; a minus sign (U+2212) when negative."""
    return f"{value:,.{digits}f}".replace("-", "\u2212")


def signed(value: float, digits: int) -> str:
    """`value` with its sign always written (+0.03, \u22121.1)."""
    return f"{value:+,.{digits}f}".replace("-", "\u2212")


def span(values: Iterable[float], digits: int, sep: str = "\u2013") -> str:
    """The smallest and largest of `values` ("9.8\u201311.7"), or one number when they are equal."""
    vals = list(values)
    low, high = num(min(vals), digits), num(max(vals), digits)
    return low if low == high else f"{low}{sep}{high}"


def core_rows(s: Summary) -> list[Row]:
    """Output tokens/s over gRPC by concurrency, and the processes' peak memory."""
    rows: list[Row] = []
    core = s.get("core")
    if core:
        tps = core["tokens_per_s"]
        streams = sorted(tps, key=int)
        rows.append(
            (
                f"core output tokens/s at {' / '.join(streams)} streams (gRPC)",
                f"{' / '.join(num(tps[c]) for c in streams)} "
                f"({streams[-1]} / {streams[0]} streams = {num(core['ratio_32_vs_1'], 1)}x)",
            )
        )
    if "core_peak_rss_mb" in s:
        figure = f"core {num(s['core_peak_rss_mb'])} MiB"
        if s.get("engine_process_peak_rss_mb"):
            figure += f", its engine process {num(s['engine_process_peak_rss_mb'])} MiB"
        rows.append(("peak RSS", figure))
    return rows


def static_rows(s: Summary) -> list[Row]:
    """The core against the same model's padded static batch, per concurrency."""
    by_streams = s.get("static", {}).get("streams")
    if not by_streams:
        return []
    streams = sorted(by_streams, key=int)
    ratios = " / ".join(f"{num(by_streams[c]['tokens_per_s_ratio'], 2)}x" for c in streams)
    ttft = " / ".join(
        f"{num(by_streams[c]['ttft_p50_ms']['core'], 1)} vs {num(by_streams[c]['ttft_p50_ms']['static'], 1)} ms"
        for c in streams
    )
    return [
        (
            f"core vs the same model's padded static batch, {' / '.join(streams)} streams: tokens/s",
            f"{ratios}; TTFT p50 {ttft}",
        )
    ]


def baseline_rows(s: Summary) -> list[Row]:
    """The core and the OpenAI gateway against `transformers serve --continuous-batching`."""
    b = s.get("baseline")
    if not b:
        return []
    ttft = b["ttft_p50_ms"]
    serve = num(ttft["serve"], 1)
    return [
        (
            "core (gRPC) vs `transformers serve --continuous-batching`, 16 streams: tokens/s",
            f"{num(b['core_vs_serve_tokens_per_s_ratio'], 2)}x; TTFT p50 {num(ttft['grpc'], 1)} vs {serve} ms",
        ),
        (
            "OpenAI gateway vs `transformers serve`, 16 streams: tokens/s",
            f"{num(b['openai_gateway_vs_serve_tokens_per_s_ratio'], 2)}x; "
            f"TTFT p50 {num(ttft['openai'], 1)} vs {serve} ms",
        ),
    ]


def gateway_rows(s: Summary) -> list[Row]:
    """Each HTTP gateway against direct gRPC: tokens/s ratio, added TTFT and ITL."""
    g = s.get("gateways")
    if not g:
        return []
    names = [n for n in GATEWAYS if n in g] + sorted(n for n in g if n not in GATEWAYS)
    label = " / ".join(GATEWAYS.get(n, n) for n in names)

    def row(what: str, fmt: Callable[[Mapping[str, Any]], str], unit: str = "") -> Row:
        return f"{label} gateway vs direct gRPC, 16 streams: {what}", " / ".join(fmt(g[n]) for n in names) + unit

    return [
        row("tokens/s", lambda r: num(r["tokens_per_s_ratio"], 3)),
        row("added TTFT p50", lambda r: signed(r["added_ttft_p50_ms"], 1), " ms"),
        row("added ITL p50", lambda r: signed(r["added_itl_p50_ms"], 2), " ms"),
    ]


def websocket_rows(s: Summary) -> list[Row]:
    """Events/s of one WebSocket gateway, and its CPU against the core's."""
    w = s.get("websocket")
    if not w:
        return []
    cfg = w.get("config", {})
    what = "WebSocket gateway"
    if "sockets" in cfg and "prompts_per_batch" in cfg:
        what += f", {cfg['sockets']} sockets x {cfg['prompts_per_batch']} prompts"
    figure = f"{num(w['events_per_s'])} events/s ({num(w['tokens_per_s'])} generated tokens/s)"
    share = w.get("cpu_share", {}).get("gateway_over_core")
    if share is not None:
        figure += f"; gateway CPU = {num(share, 2)} x core CPU"
    return [(what, figure)]


def guided_rows(s: Summary) -> list[Row]:
    """Requests constrained to a JSON schema against free ones."""
    g = s.get("guided")
    if not g:
        return []
    return [
        (
            "guided decoding (a JSON schema) vs free requests, 16 streams over gRPC",
            f"tokens/s {num(g['tokens_per_s_ratio'], 3)}x; core CPU per generated token "
            f"{num(g['core_cpu_per_token_ratio'], 2)}x; ITL p50 {signed(g['added_itl_p50_ms'], 2)} ms",
        )
    ]


def overhead_rows(s: Summary) -> list[Row]:
    """CPU µs per streamed token of the core and of each gateway on the mock engine at the most
    streams measured, ITL above the step at the fewest, and the engine's own floor."""
    o = s.get("overhead")
    if not o or not o.get("runs"):
        return []
    runs, cfg = o["runs"], o.get("config", {})
    streams = sorted({int(n) for by_streams in runs.values() for n in by_streams})
    most, fewest = str(streams[-1]), str(streams[0])
    busy = {g: runs[g][most] for g in OVERHEAD_GATEWAYS if most in runs.get(g, {})}
    step = f"{num(cfg['step_ms'])} ms steps, " if "step_ms" in cfg else ""
    rows: list[Row] = []

    core = []
    if "mux" in runs and most in runs["mux"]:
        core.append(f"{num(runs['mux'][most]['cpu_us_per_token']['core'], 1)} on MultiplexGenerate")
    if busy:
        core.append(f"{span((r['cpu_us_per_token']['core'] for r in busy.values()), 1)} behind each gateway")
    if "grpc" in runs and most in runs["grpc"]:
        core.append(f"{num(runs['grpc'][most]['cpu_us_per_token']['core'], 1)} serving per-request Generate calls")
    if core:
        rows.append(
            (f"serving overhead (mock engine, {step}{most} streams): core CPU µs per streamed token", ", ".join(core))
        )

    if busy:
        parts = []
        for g, r in busy.items():
            per_event = r.get("cpu_us_per_event", {}).get("gateway")
            if per_event is not None:
                parts.append(f"{OVERHEAD_GATEWAYS[g]} {num(per_event, 1)} per PROGRESS event")
            else:
                parts.append(f"{OVERHEAD_GATEWAYS[g]} {num(r['cpu_us_per_token']['gateway'], 1)}")
        figure = ", ".join(parts)
        kernel = [k for r in busy.values() if (k := r.get("system_us_per_token", {}).get("gateway")) is not None]
        if kernel:
            figure += f" (kernel time {span(kernel, 1)} of each)"
        rows.append((f"serving overhead ({most} streams): gateway CPU µs per streamed token", figure))

    above = [runs[g][fewest]["itl_above_step_ms"]["p50"] for g in OVERHEAD_GATEWAYS if fewest in runs.get(g, {})]
    above = [a for a in above if a is not None]
    if above:
        rows.append(
            (f"ITL above the step at {fewest} streams, p50, through each gateway", f"{span(above, 2, ' to ')} ms")
        )
    floor = o.get("engine_floor")
    if floor:
        rows.append(
            ("mock engine alone with a bare consumer (the floor)", f"{num(floor['cpu_us_per_token'], 2)} µs per token")
        )
    return rows


def prefix_rows(s: Summary) -> list[Row]:
    """The prefix cache against `--no-prefix-cache` (shared prefix, multi-turn), the fleet's
    token hit rate by routing, and the memory soak (scripts/bench/prefix.py's shape)."""
    p = s.get("prefix")
    if not p:
        return []
    rows: list[Row] = []
    if "shared" in p:
        sh = p["shared"]
        rows.append(
            (
                "prefix cache vs none: 768 shared + 32 own prompt tokens, 32 new, 8 streams",
                f"TTFT p50 {num(sh['cache']['ttft_p50_ms'], 1)} vs {num(sh['no_cache']['ttft_p50_ms'], 1)} ms "
                f"({num(sh['ttft_p50_ratio'], 2)}x); tokens/s {num(sh['tokens_per_s_ratio'], 2)}x",
            )
        )
    if "multiturn" in p:
        mt = p["multiturn"]
        on, off = mt["cache"]["ttft_p50_ms_per_turn"], mt["no_cache"]["ttft_p50_ms_per_turn"]
        rows.append(
            (
                f"prefix cache vs none: {len(on)}-turn chats (+24 user tokens a turn), 8 conversations",
                f"turn-{len(on)} TTFT p50 {num(on[-1], 1)} vs {num(off[-1], 1)} ms "
                f"({num(mt['last_turn_ttft_ratio'], 2)}x); tokens/s {num(mt['tokens_per_s_ratio'], 2)}x",
            )
        )
    if "fleet" in p:
        f = p["fleet"]
        for config, what in (("ample", "ample caches"), ("bounded", "caches of {share} % of the working set")):
            c = f[config]
            share = num(100 * f["bound_share"]) if "bound_share" in f else ""
            rows.append(
                (
                    f"token hit rate, 12 chats over 3 cores, {what.format(share=share)}: "
                    "prefix routing / round robin / one core",
                    f"{num(100 * c['prefix']['hit_rate'], 1)} / {num(100 * c['round_robin']['hit_rate'], 1)} / "
                    f"{num(100 * c['one_core']['hit_rate'], 1)} %",
                )
            )
    if "vllm" in p and "trellis" in p["vllm"]:
        v = p["vllm"]
        t, b = v["trellis"], v["vllm"]
        rows.append(
            (
                "vs vLLM CPU, same HTTP client, shared prefix: tokens/s, TTFT p50",
                f"{num(t['shared_tokens_per_s'])} vs {num(b['shared_tokens_per_s'])} "
                f"({num(t['shared_tokens_per_s'] / b['shared_tokens_per_s'], 2)}x); "
                f"{num(t['shared_ttft_p50_ms'], 1)} vs {num(b['shared_ttft_p50_ms'], 1)} ms",
            )
        )
        rows.append(
            (
                "vs vLLM CPU, same HTTP client, multi-turn: tokens/s, TTFT p50 (all turns)",
                f"{num(t['multiturn_tokens_per_s'])} vs {num(b['multiturn_tokens_per_s'])} "
                f"({num(t['multiturn_tokens_per_s'] / b['multiturn_tokens_per_s'], 2)}x); "
                f"{num(t['multiturn_ttft_p50_ms'], 1)} vs {num(b['multiturn_ttft_p50_ms'], 1)} ms",
            )
        )
    if "memory" in p:
        m = p["memory"]
        rows.append(
            (
                f"memory over {num(m['prompts'])} distinct prompts, prefix cache on",
                f"RSS {signed(100 * m['rss_growth_after_first_1000'], 1)} % after the first 1,000; cache at most "
                f"{num(max(m['cache_blocks_per_1000']))} of {num(m['cache_block_bound'])} blocks",
            )
        )
    return rows


def lora_rows(s: Summary) -> list[Row]:
    """Requests over LoRA adapters against the base model alone, and the share of a fleet's
    adapter requests that reach a core holding their adapter (scripts/bench/lora_fleet.py)."""
    rows: list[Row] = []
    lo = s.get("lora")
    if lo and "tokens_per_s_ratio" in lo:
        rows.append(
            (
                "requests over 4 LoRA adapters vs the base model alone, 16 streams over gRPC",
                f"tokens/s {num(lo['tokens_per_s_ratio'], 2)}x; TTFT p50 {signed(lo['added_ttft_p50_ms'], 1)} ms; "
                f"ITL p50 {signed(lo['added_itl_p50_ms'], 2)} ms",
            )
        )
    fleet = s.get("lora_fleet")
    if fleet:
        setup = fleet["setup"]
        share = {k: num(100 * v["resident_share"], 1) for k, v in fleet.items() if k != "setup"}
        rows.append(
            (
                f"adapter requests that reach a core holding their adapter, {setup['adapters']} adapters over "
                f"{setup['cores']} cores of {setup['max_loras']} slots: adapter affinity / round robin",
                f"uniform {share['uniform_affinity']} / {share['uniform_round_robin']} %, "
                f"skewed {share['skewed_affinity']} / {share['skewed_round_robin']} %",
            )
        )
    return rows


def fairness_rows(s: Summary) -> list[Row]:
    """A noisy tenant's effect on a quiet one, priorities under overload, and tracing's cost
    (scripts/bench/fairness.py's shape; the core's own TTFT clock)."""
    f = s.get("fairness")
    if not f or "goals" not in f:
        return []
    g = f["goals"]
    off = g.get("no_preemption", {})
    rows: list[Row] = [
        (
            "quiet tenant's TTFT p99 beside a noisy one at 10x its rate vs alone (core clock), "
            "with / without preemption; Jain's index by weight",
            f"{num(g['noisy_b_core_p99_ratio'], 2)}x / {num(off['noisy_b_core_p99_ratio'], 2)}x; "
            f"{num(g['weighted_jain'], 3)}",
        ),
        (
            "high-priority requests' TTFT p99 under 2x overload vs an idle core (core clock), "
            "with / without preemption",
            f"{num(g['priority_core_p99_ratio'], 2)}x / {num(off['priority_core_p99_ratio'], 2)}x",
        ),
    ]
    tracing = f.get("tracing", {})
    if "on_vs_off" in tracing:
        cfg, ratio = tracing["config"], tracing["on_vs_off"]
        rows.append(
            (
                f"tracing on ({num(100 * cfg['sample_ratio'])} % of requests sampled) vs off, {cfg['streams']} "
                "streams through the OpenAI gateway",
                f"CPU per token {num(ratio['cpu_us_per_token'], 3)}x; tokens/s {num(ratio['tokens_per_s'], 3)}x",
            )
        )
    return rows


SECTIONS: tuple[Callable[[Summary], list[Row]], ...] = (
    core_rows,
    static_rows,
    baseline_rows,
    gateway_rows,
    websocket_rows,
    guided_rows,
    overhead_rows,
    prefix_rows,
    lora_rows,
    fairness_rows,
)


def measured_on(s: Summary) -> str | None:
    """The UTC date(s) of the runs that wrote the summary ("2026-11-25"), or None if unknown."""
    stamps = [s.get("measured_at"), s.get("overhead", {}).get("measured_at")]
    dates = sorted(
        {datetime.datetime.fromisoformat(t).astimezone(datetime.UTC).date().isoformat() for t in stamps if t}
    )
    return " and ".join(dates) if dates else None


def render(s: Summary) -> str:
    """The figures section (without its markers): a line saying when and where, then the table.

    Raises:
        KeyError: a section lacks a figure its shape requires (a summary of another shape).
    """
    rows = [row for section in SECTIONS for row in section(s)]
    if not rows:
        return "No figures yet: run `make bench`."
    when = measured_on(s)
    cpus = s.get("machine", {}).get("cpus") or s.get("overhead", {}).get("config", {}).get("cpus")
    head = "Measured" + (f" {when}" if when else "") + (f" on a machine with {cpus} CPUs" if cpus else "")
    setup = []
    if s.get("model"):
        setup.append(f"model `{s['model']}`")
    if s.get("max_new_tokens"):
        setup.append(f"{s['max_new_tokens']} new tokens per request")
    if s.get("rounds"):
        setup.append(f"comparisons: the median of {s['rounds']} alternated rounds")
    lines = [head + (f" ({'; '.join(setup)})" if setup else "") + ":", "", "| what | figure |", "|---|---|"]
    lines += [f"| {what} | {figure} |" for what, figure in rows]
    return "\n".join(lines)


def replace_figures(document: str, figures: str) -> str:
    """`document` with the text between FIGURES_BEGIN and FIGURES_END replaced by `figures`.

    Raises:
        ValueError: a marker is missing, repeated, or the end comes before the begin.
    """
    if document.count(FIGURES_BEGIN) != 1 or document.count(FIGURES_END) != 1:
        raise ValueError(f"the document needs exactly one {FIGURES_BEGIN} and one {FIGURES_END} line")
    head, _, rest = document.partition(FIGURES_BEGIN)
    if FIGURES_END not in rest:
        raise ValueError(f"{FIGURES_END} comes before {FIGURES_BEGIN}")
    _, _, tail = rest.partition(FIGURES_END)
    return f"{head}{FIGURES_BEGIN}\n{figures.strip()}\n{FIGURES_END}{tail}"


def update(summary_path: Path, doc_path: Path) -> None:
    """Rewrite the figures section of `doc_path` from the summary at `summary_path`.

    Raises:
        OSError: a file cannot be read or written.
        ValueError: the summary is not JSON, or the document lacks its markers.
        KeyError: the summary is not of run_all.py's shape.
    """
    summary = json.loads(summary_path.read_text())
    document = doc_path.read_text()
    doc_path.write_text(replace_figures(document, render(summary)))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring); 1 with a message when it fails."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", default=str(ROOT / "bench-results/summary.json"))
    p.add_argument("--doc", default=str(ROOT / "docs/performance.md"))
    args = p.parse_args(argv)
    try:
        update(Path(args.summary), Path(args.doc))
    except (OSError, ValueError, KeyError) as e:
        print(f"report: {args.doc} not updated: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"report: wrote the figures of {args.summary} into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
