"""LMI gateway flags and their environment fallbacks (TRELLIS_GATEWAY_*, and DJL's OPTION_TGI_COMPAT)."""

from __future__ import annotations

import pytest

from gateways import lmi
from gateways.common.config import load
from gateways.lmi.config import LmiSettings, load_settings


def options(argv=(), **environ) -> LmiSettings:
    return load_settings(load("lmi", lmi.DEFAULT_PORT, lmi.add_arguments, list(argv), environ=environ))


def test_defaults():
    assert load("lmi", lmi.DEFAULT_PORT, lmi.add_arguments, [], environ={}).port == 8080
    assert options() == LmiSettings(batching="rolling", tgi_compat=False, output_formatter=None, enable_streaming=False)


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {"OPTION_TGI_COMPAT": "true"}, True),
        ([], {"OPTION_TGI_COMPAT": "false"}, False),
        ([], {"OPTION_TGI_COMPAT": ""}, False),
        ([], {"OPTION_TGI_COMPAT": "true", "TRELLIS_GATEWAY_TGI_COMPAT": ""}, True),
        ([], {"TRELLIS_GATEWAY_TGI_COMPAT": "1"}, True),
        ([], {"OPTION_TGI_COMPAT": "true", "TRELLIS_GATEWAY_TGI_COMPAT": "false"}, False),
        (["--no-tgi-compat"], {"OPTION_TGI_COMPAT": "true"}, False),
        (["--tgi-compat"], {}, True),
    ],
)
def test_tgi_compat_sources(argv, environ, expected):
    assert options(argv, **environ).tgi_compat is expected


@pytest.mark.parametrize(
    ("argv", "environ", "name", "value"),
    [
        (["--batching", "dynamic"], {}, "batching", "dynamic"),
        ([], {"TRELLIS_GATEWAY_BATCHING": "dynamic"}, "batching", "dynamic"),
        ([], {"TRELLIS_GATEWAY_OUTPUT_FORMATTER": "sse"}, "output_formatter", "sse"),
        (["--enable-streaming"], {}, "enable_streaming", True),
    ],
)
def test_flags(argv, environ, name, value):
    assert getattr(options(argv, **environ), name) == value


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--batching", "static"], {}),
        ([], {"TRELLIS_GATEWAY_OUTPUT_FORMATTER": "json"}),
        ([], {"OPTION_TGI_COMPAT": "maybe"}),
    ],
)
def test_bad_values_are_usage_errors(argv, environ):
    with pytest.raises(SystemExit):
        options(argv, **environ)
