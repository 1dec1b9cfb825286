"""The tracing settings both islands share (oteltrace): flags and OTEL_* variables resolved to an
endpoint and a ratio, every refusal with its message, the flags as each island's parser gets
them, and W3C traceparent in and out. The spans themselves: tests/integration/test_tracing.py."""

from __future__ import annotations

import argparse
import re

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from core.config import load as load_core
from gateways.common.config import load as load_gateway
from oteltrace import TracingSettings, parent_context, resolve_tracing, sample_ratio, traceparent_of

URL = "http://collector:4318/v1/traces"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("endpoint", "ratio", "environ", "expected"),
    [
        ("", None, {}, None),
        (URL, None, {}, TracingSettings(URL, 1.0)),
        (URL, 0.25, {"OTEL_TRACES_SAMPLER_ARG": "0.5"}, TracingSettings(URL, 0.25)),
        (URL, None, {"OTEL_TRACES_SAMPLER_ARG": "0.5"}, TracingSettings(URL, 0.5)),
        (URL, None, {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
         TracingSettings(URL, 0.1)),
        # Another sampler's argument is not a ratio.
        (URL, None, {"OTEL_TRACES_SAMPLER": "jaeger_remote", "OTEL_TRACES_SAMPLER_ARG": "x=1"},
         TracingSettings(URL, 1.0)),
        ("", None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}, TracingSettings(URL, 1.0)),
        ("", None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, TracingSettings("http://c:4318/v1/traces", 1.0)),
        ("http://c:4318", None, {}, TracingSettings("http://c:4318/v1/traces", 1.0)),
        ("https://c/otlp/traces", 0.0, {}, TracingSettings("https://c/otlp/traces", 0.0)),
        ("", None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL, "OTEL_TRACES_EXPORTER": "none"}, None),
        (URL, None, {"OTEL_TRACES_EXPORTER": "none"}, TracingSettings(URL, 1.0)),
        (URL, None, {"OTEL_SDK_DISABLED": "true"}, None),
    ],
)  # fmt: skip
def test_settings_from_flags_and_variables(endpoint, ratio, environ, expected):
    assert resolve_tracing(endpoint, ratio, environ) == expected


@pytest.mark.parametrize(
    ("endpoint", "environ", "message"),
    [
        ("collector:4318", {}, "--otlp-traces-endpoint must be an http:// or https:// URL, got 'collector:4318'"),
        ("grpc://c:4317", {}, "--otlp-traces-endpoint must be an http:// or https:// URL, got 'grpc://c:4317'"),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "c:4318"}, "must be an http:// or https:// URL, got 'c:4318'"),
        (URL, {"OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG: expected a number from 0 to 1, got '2'"),
        (
            URL,
            {"OTEL_TRACES_SAMPLER_ARG": "half"},
            "OTEL_TRACES_SAMPLER_ARG: expected a number from 0 to 1, got 'half'",
        ),
    ],
)
def test_refused_settings_say_why(endpoint, environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tracing(endpoint, None, environ)


@pytest.mark.parametrize("raw", ["-0.1", "1.5", "nan", "x"])
def test_a_ratio_outside_0_to_1_is_refused(raw):
    with pytest.raises(argparse.ArgumentTypeError, match=f"expected a number from 0 to 1, got '{raw}'"):
        sample_ratio(raw)


def test_each_island_parses_the_flags_and_their_variables():
    core = load_core(["--model", "m", "--otlp-traces-endpoint", URL, "--otlp-traces-sample-ratio", "0.1"], {})
    assert (core.otlp_traces_endpoint, core.otlp_traces_sample_ratio) == (URL, 0.1)
    assert load_core(["--model", "m"], {}).otlp_traces_endpoint == ""
    env = {"TRELLIS_GATEWAY_OTLP_TRACES_ENDPOINT": URL, "TRELLIS_GATEWAY_OTLP_TRACES_SAMPLE_RATIO": "0.5"}
    gateway = load_gateway("openai", 8000, lambda p: None, [], env)
    assert (gateway.otlp_traces_endpoint, gateway.otlp_traces_sample_ratio) == (URL, 0.5)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--otlp-traces-sample-ratio", "3"], {}, "expected a number from 0 to 1, got '3'"),
        (["--otlp-traces-endpoint", "c:4318"], {}, "must be an http:// or https:// URL"),
        (["--otlp-traces-endpoint", URL], {"OTEL_TRACES_SAMPLER_ARG": "9"}, "OTEL_TRACES_SAMPLER_ARG"),
    ],
)
def test_each_island_refuses_bad_settings_at_start(argv, environ, message, capsys):
    with pytest.raises(SystemExit):
        load_core(["--model", "m", *argv], environ)
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_gateway("lmi", 8080, lambda p: None, argv, environ)
    assert message in capsys.readouterr().err


def test_traceparent_in_and_out():
    context = parent_context(TRACEPARENT)
    assert context is not None
    span = trace.get_current_span(context)
    assert traceparent_of(span) == TRACEPARENT
    unsampled = NonRecordingSpan(SpanContext(0xAB, 0xCD, is_remote=False, trace_flags=TraceFlags(0)))
    assert traceparent_of(unsampled) == f"00-{0xAB:032x}-{0xCD:016x}-00"


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # an invalid (all zero) trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff is invalid
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case is not W3C's
        "nonsense",
    ],
)
def test_a_traceparent_that_does_not_parse_is_no_parent(raw):
    assert parent_context(raw) is None
    assert traceparent_of(trace.INVALID_SPAN) == ""
