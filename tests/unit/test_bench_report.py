"""scripts/bench/report.py: the figures table of docs/performance.md rendered from a
summary.json of run_all.py's shape, written between the document's markers, and its errors."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "scripts" / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load()


def summary() -> dict:
    """A small summary.json of every section, in run_all.py's and overhead.py's shapes."""
    ws_256 = {
        "cpu_us_per_token": {"core": 10.9, "gateway": 12.9},
        "cpu_us_per_event": {"gateway": 14.0},
        "system_us_per_token": {"gateway": 6.2},
    }
    return {
        "model": "models/demo",
        "max_new_tokens": 64,
        "rounds": 3,
        "measured_at": "2026-11-25T23:53:00+00:00",
        "machine": {"cpus": 2},
        "core": {"tokens_per_s": {"1": 252.3, "8": 1198.2, "32": 3035.4}, "ratio_32_vs_1": 12.07},
        "core_peak_rss_mb": 366.2,
        "engine_process_peak_rss_mb": 442.1,
        "static": {
            "threads": 1,
            "streams": {
                "32": {"tokens_per_s_ratio": 1.02, "ttft_p50_ms": {"core": 28.8, "static": 94.3}},
                "16": {"tokens_per_s_ratio": 0.98, "ttft_p50_ms": {"core": 22.2, "static": 49.9}},
            },
        },
        "baseline": {
            "core_vs_serve_tokens_per_s_ratio": 1.56,
            "openai_gateway_vs_serve_tokens_per_s_ratio": 1.54,
            "ttft_p50_ms": {"grpc": 27.4, "openai": 25.2, "serve": 39.0},
        },
        "gateways": {
            "triton": {"tokens_per_s_ratio": 1.002, "added_ttft_p50_ms": -1.3, "added_itl_p50_ms": -0.15},
            "lmi": {"tokens_per_s_ratio": 0.985, "added_ttft_p50_ms": -1.1, "added_itl_p50_ms": 0.03},
            "openai": {"tokens_per_s_ratio": 1.035, "added_ttft_p50_ms": 2.8, "added_itl_p50_ms": -0.19},
        },
        "websocket": {
            "config": {"sockets": 64, "prompts_per_batch": 4},
            "events_per_s": 3214.0,
            "tokens_per_s": 3025.0,
            "cpu_share": {"gateway_over_core": 0.81},
        },
        "guided": {"tokens_per_s_ratio": 0.942, "core_cpu_per_token_ratio": 0.98, "added_itl_p50_ms": 0.54},
        "overhead": {
            "measured_at": "2026-11-25T23:40:00+00:00",
            "config": {"engine": "mock", "step_ms": 10.0, "streams": [64, 256], "cpus": 2},
            "engine_floor": {"cpu_us_per_token": 2.43},
            "runs": {
                "grpc": {"256": {"cpu_us_per_token": {"core": 66.8}}},
                "mux": {"256": {"cpu_us_per_token": {"core": 10.1}}},
                "lmi": {
                    "64": {"itl_above_step_ms": {"p50": -0.05}},
                    "256": {
                        "cpu_us_per_token": {"core": 11.7, "gateway": 16.4},
                        "system_us_per_token": {"gateway": 7.0},
                    },
                },
                "openai": {
                    "64": {"itl_above_step_ms": {"p50": 0.08}},
                    "256": {
                        "cpu_us_per_token": {"core": 9.8, "gateway": 16.9},
                        "system_us_per_token": {"gateway": 6.4},
                    },
                },
                "triton": {
                    "64": {"itl_above_step_ms": {"p50": 0.01}},
                    "256": {
                        "cpu_us_per_token": {"core": 10.4, "gateway": 17.1},
                        "system_us_per_token": {"gateway": 5.9},
                    },
                },
                "ws": {"64": {"itl_above_step_ms": {"p50": 0.02}}, "256": ws_256},
            },
        },
        "prefix": {
            "shared": {
                "cache": {"ttft_p50_ms": 12.5},
                "no_cache": {"ttft_p50_ms": 50.0},
                "ttft_p50_ratio": 0.25,
                "tokens_per_s_ratio": 2.1,
            },
            "multiturn": {
                "cache": {"ttft_p50_ms_per_turn": [9.0, 8.0, 7.5]},
                "no_cache": {"ttft_p50_ms_per_turn": [9.0, 12.0, 25.0]},
                "last_turn_ttft_ratio": 0.3,
                "tokens_per_s_ratio": 1.6,
            },
            "fleet": {
                "ample": {
                    "prefix": {"hit_rate": 0.8},
                    "round_robin": {"hit_rate": 0.35},
                    "one_core": {"hit_rate": 0.85},
                },
                "bounded": {
                    "prefix": {"hit_rate": 0.7},
                    "round_robin": {"hit_rate": 0.1},
                    "one_core": {"hit_rate": 0.05},
                },
                "bound_share": 0.402,
            },
            "vllm": {
                "trellis": {
                    "shared_tokens_per_s": 900.0,
                    "shared_ttft_p50_ms": 120.0,
                    "multiturn_tokens_per_s": 800.0,
                    "multiturn_ttft_p50_ms": 60.0,
                },
                "vllm": {
                    "shared_tokens_per_s": 600.0,
                    "shared_ttft_p50_ms": 150.0,
                    "multiturn_tokens_per_s": 1000.0,
                    "multiturn_ttft_p50_ms": 40.0,
                },
            },
            "memory": {
                "prompts": 10000,
                "rss_growth_after_first_1000": 0.012,
                "cache_blocks_per_1000": [256, 256],
                "cache_block_bound": 256,
            },
        },
        "lora": {"tokens_per_s_ratio": 0.9016, "added_ttft_p50_ms": -0.63, "added_itl_p50_ms": 0.786},
        "lora_fleet": {
            "setup": {"cores": 3, "max_loras": 2, "adapters": 6},
            "uniform_affinity": {"resident_share": 0.99},
            "uniform_round_robin": {"resident_share": 0.3717},
            "skewed_affinity": {"resident_share": 0.9383},
            "skewed_round_robin": {"resident_share": 0.5833},
        },
        "fairness": {
            "goals": {
                "noisy_b_core_p99_ratio": 1.28,
                "weighted_jain": 1.0,
                "priority_core_p99_ratio": 1.0,
                "no_preemption": {"noisy_b_core_p99_ratio": 1.42, "priority_core_p99_ratio": 1.24},
            },
            "tracing": {
                "config": {"sample_ratio": 0.1, "streams": 64},
                "on_vs_off": {"tokens_per_s": 0.9831, "cpu_us_per_token": 1.0453},
            },
        },
    }


def table(text: str) -> dict[str, str]:
    """The `| what | figure |` rows of a rendered section."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {what.strip(): figure.strip() for what, figure in rows if what.strip() != "what"}


def test_every_section_renders_its_row():
    text = report.render(summary())
    assert text.splitlines()[0] == (
        "Measured 2026-11-25 on a machine with 2 CPUs (model `models/demo`; 64 new tokens per request; "
        "comparisons: the median of 3 alternated rounds):"
    )
    assert table(text) == {
        "core output tokens/s at 1 / 8 / 32 streams (gRPC)": "252 / 1,198 / 3,035 (32 / 1 streams = 12.1x)",
        "peak RSS": "core 366 MiB, its engine process 442 MiB",
        "core vs the same model's padded static batch, 16 / 32 streams: tokens/s": (
            "0.98x / 1.02x; TTFT p50 22.2 vs 49.9 ms / 28.8 vs 94.3 ms"
        ),
        "core (gRPC) vs `transformers serve --continuous-batching`, 16 streams: tokens/s": (
            "1.56x; TTFT p50 27.4 vs 39.0 ms"
        ),
        "OpenAI gateway vs `transformers serve`, 16 streams: tokens/s": "1.54x; TTFT p50 25.2 vs 39.0 ms",
        "LMI / OpenAI / Triton gateway vs direct gRPC, 16 streams: tokens/s": "0.985 / 1.035 / 1.002",
        "LMI / OpenAI / Triton gateway vs direct gRPC, 16 streams: added TTFT p50": "\u22121.1 / +2.8 / \u22121.3 ms",
        "LMI / OpenAI / Triton gateway vs direct gRPC, 16 streams: added ITL p50": (
            "+0.03 / \u22120.19 / \u22120.15 ms"
        ),
        "WebSocket gateway, 64 sockets x 4 prompts": (
            "3,214 events/s (3,025 generated tokens/s); gateway CPU = 0.81 x core CPU"
        ),
        "guided decoding (a JSON schema) vs free requests, 16 streams over gRPC": (
            "tokens/s 0.942x; core CPU per generated token 0.98x; ITL p50 +0.54 ms"
        ),
        "serving overhead (mock engine, 10 ms steps, 256 streams): core CPU µs per streamed token": (
            "10.1 on MultiplexGenerate, 9.8\u201311.7 behind each gateway, 66.8 serving per-request Generate calls"
        ),
        "serving overhead (256 streams): gateway CPU µs per streamed token": (
            "LMI 16.4, OpenAI 16.9, Triton 17.1, WebSocket 14.0 per PROGRESS event (kernel time 5.9\u20137.0 of each)"
        ),
        "ITL above the step at 64 streams, p50, through each gateway": "\u22120.05 to 0.08 ms",
        "mock engine alone with a bare consumer (the floor)": "2.43 µs per token",
        "prefix cache vs none: 768 shared + 32 own prompt tokens, 32 new, 8 streams": (
            "TTFT p50 12.5 vs 50.0 ms (0.25x); tokens/s 2.10x"
        ),
        "prefix cache vs none: 3-turn chats (+24 user tokens a turn), 8 conversations": (
            "turn-3 TTFT p50 7.5 vs 25.0 ms (0.30x); tokens/s 1.60x"
        ),
        "token hit rate, 12 chats over 3 cores, ample caches: prefix routing / round robin / one core": (
            "80.0 / 35.0 / 85.0 %"
        ),
        "token hit rate, 12 chats over 3 cores, caches of 40 % of the working set: prefix routing / round robin / "
        "one core": "70.0 / 10.0 / 5.0 %",
        "vs vLLM CPU, same HTTP client, shared prefix: tokens/s, TTFT p50": "900 vs 600 (1.50x); 120.0 vs 150.0 ms",
        "vs vLLM CPU, same HTTP client, multi-turn: tokens/s, TTFT p50 (all turns)": (
            "800 vs 1,000 (0.80x); 60.0 vs 40.0 ms"
        ),
        "memory over 10,000 distinct prompts, prefix cache on": "RSS +1.2 % after the first 1,000; cache at most "
        "256 of 256 blocks",
        "requests over 4 LoRA adapters vs the base model alone, 16 streams over gRPC": (
            "tokens/s 0.90x; TTFT p50 \u22120.6 ms; ITL p50 +0.79 ms"
        ),
        "adapter requests that reach a core holding their adapter, 6 adapters over 3 cores of 2 slots: adapter "
        "affinity / round robin": "uniform 99.0 / 37.2 %, skewed 93.8 / 58.3 %",
        "quiet tenant's TTFT p99 beside a noisy one at 10x its rate vs alone (core clock), with / without "
        "preemption; Jain's index by weight": "1.28x / 1.42x; 1.000",
        "high-priority requests' TTFT p99 under 2x overload vs an idle core (core clock), with / without "
        "preemption": "1.00x / 1.24x",
        "tracing on (10 % of requests sampled) vs off, 64 streams through the OpenAI gateway": (
            "CPU per token 1.045x; tokens/s 0.983x"
        ),
    }


def test_missing_sections_leave_their_rows_out():
    partial = {k: v for k, v in summary().items() if k in ("machine", "overhead")}
    rows = table(report.render(partial))
    assert len(rows) == 4
    assert all(what.startswith(("serving overhead", "ITL above", "mock engine")) for what in rows)
    assert report.render({}) == "No figures yet: run `make bench`."


def test_runs_of_two_days_show_both_dates():
    s = summary()
    s["overhead"]["measured_at"] = "2026-11-24T22:00:00+00:00"
    assert report.render(s).startswith("Measured 2026-11-24 and 2026-11-25 on a machine with 2 CPUs")


def test_figures_are_replaced_between_the_markers_only():
    document = "# Performance\n\nMethod.\n\n<!-- figures:begin -->\nold table\n<!-- figures:end -->\n\nMore prose.\n"
    once = report.replace_figures(document, "new table\n")
    assert (
        once == "# Performance\n\nMethod.\n\n<!-- figures:begin -->\nnew table\n<!-- figures:end -->\n\nMore prose.\n"
    )
    assert report.replace_figures(once, "new table") == once


@pytest.mark.parametrize(
    "document",
    [
        "no markers at all\n",
        "<!-- figures:begin -->\nonly the begin\n",
        "<!-- figures:end -->\nend first\n<!-- figures:begin -->\n",
        "<!-- figures:begin -->\n<!-- figures:begin -->\n<!-- figures:end -->\n",
    ],
)
def test_a_document_without_its_markers_is_refused(document):
    with pytest.raises(ValueError, match="figures:"):
        report.replace_figures(document, "table")


def test_update_writes_the_document(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary()))
    doc = tmp_path / "performance.md"
    doc.write_text("Intro.\n<!-- figures:begin -->\n<!-- figures:end -->\nOutro.\n")
    assert report.main(["--summary", str(path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("Intro.\n<!-- figures:begin -->\nMeasured 2026-11-25")
    assert text.endswith("| CPU per token 1.045x; tokens/s 0.983x |\n<!-- figures:end -->\nOutro.\n")


def test_the_repository_document_has_its_markers_and_no_commit_hash():
    text = (ROOT / "docs" / "performance.md").read_text()
    figures = text.split(report.FIGURES_BEGIN)[1].split(report.FIGURES_END)[0]
    assert table(figures), "docs/performance.md has no figures table between its markers"
    assert report.replace_figures(text, figures) == text
    # A commit id: 7 to 40 hex digits with at least one letter and one digit.
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)


@pytest.mark.parametrize(
    ("summary_text", "document", "error"),
    [
        (None, "<!-- figures:begin -->\n<!-- figures:end -->\n", "FileNotFoundError"),
        ("{not json", "<!-- figures:begin -->\n<!-- figures:end -->\n", "JSONDecodeError"),
        (
            json.dumps({"core": {"tokens_per_s": {"1": 1.0}}}),
            "<!-- figures:begin -->\n<!-- figures:end -->\n",
            "KeyError",
        ),
        (json.dumps(summary()), "no markers\n", "ValueError"),
    ],
)
def test_update_failures_leave_the_document_and_say_why(tmp_path, capsys, summary_text, document, error):
    path = tmp_path / "summary.json"
    if summary_text is not None:
        path.write_text(summary_text)
    doc = tmp_path / "performance.md"
    doc.write_text(document)
    assert report.main(["--summary", str(path), "--doc", str(doc)]) == 1
    assert doc.read_text() == document
    assert f"not updated: {error}" in capsys.readouterr().err
