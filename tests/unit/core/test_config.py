"""Flags with environment fallbacks (TRELLIS_CORE_*)."""

from __future__ import annotations

import pytest

from core.config import load


def test_defaults_and_flags():
    c = load(["--model", "/m"], {})
    assert (c.model, c.engine, c.port, c.served_model_name) == ("/m", "hf", 50051, "m")
    c = load(["--model", "/m/", "--port", "1", "--model-name", "x"], {})
    assert (c.port, c.served_model_name) == (1, "x")


def test_environment_fallbacks_and_flag_precedence():
    env = {"TRELLIS_CORE_MODEL": "/env", "TRELLIS_CORE_PORT": "7", "TRELLIS_CORE_TRT_ENABLE_BLOCK_REUSE": "false"}
    c = load([], env)
    assert (c.model, c.port, c.trt_enable_block_reuse) == ("/env", 7, False)
    assert load(["--port", "8"], env).port == 8


def test_an_empty_boolean_keeps_the_default():
    env = {"TRELLIS_CORE_TRT_ENABLE_BLOCK_REUSE": "", "TRELLIS_CORE_TRT_ENABLE_CHUNKED_CONTEXT": " "}
    c = load(["--model", "/m"], env)
    assert (c.trt_enable_block_reuse, c.trt_enable_chunked_context) == (True, False)


@pytest.mark.parametrize(
    "env",
    [{"TRELLIS_CORE_PORT": "x"}, {"TRELLIS_CORE_ENGINE": "nope"}, {"TRELLIS_CORE_TRT_ENABLE_BLOCK_REUSE": "maybe"}],
)
def test_malformed_environment_values_are_usage_errors(env, capsys):
    with pytest.raises(SystemExit) as e:
        load(["--model", "/m"], env)
    assert e.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_model_is_required(capsys):
    with pytest.raises(SystemExit):
        load([], {})
    assert "--model" in capsys.readouterr().err
