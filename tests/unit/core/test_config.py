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


def test_chunked_prefill_is_on_unless_turned_off():
    """--trt-enable-chunked-prefill (trtllm-llm) defaults on; --no-... and the environment turn it off."""
    assert load(["--model", "/m"], {}).trt_enable_chunked_prefill is True
    assert load(["--model", "/m", "--no-trt-enable-chunked-prefill"], {}).trt_enable_chunked_prefill is False
    env = {"TRELLIS_CORE_TRT_ENABLE_CHUNKED_PREFILL": "false"}
    assert load(["--model", "/m"], env).trt_enable_chunked_prefill is False
    assert load(["--model", "/m", "--trt-enable-chunked-prefill"], env).trt_enable_chunked_prefill is True


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


def test_mock_engine_flags():
    c = load(["--model", "/m", "--engine", "mock", "--mock-step-ms", "2.5", "--mock-eos-probability", "0.1"], {})
    assert (c.engine, c.mock_step_ms, c.mock_eos_probability, c.mock_prefill_ms_per_token) == ("mock", 2.5, 0.1, 0.0)
    c = load(
        ["--model", "/m"], {"TRELLIS_CORE_MOCK_PREFILL_MS_PER_TOKEN": "0.02", "TRELLIS_CORE_MOCK_CONTEXT_LENGTH": "64"}
    )
    assert (c.mock_prefill_ms_per_token, c.mock_context_length) == (0.02, 64)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--mock-eos-probability", "2"], {}, "must be in [0, 1]"),
        (["--mock-step-ms", "nan"], {}, "finite number >= 0"),
        (["--mock-step-ms", "soon"], {}, "expected a number"),
        ([], {"TRELLIS_CORE_MOCK_PREFILL_MS_PER_TOKEN": "-1"}, "TRELLIS_CORE_MOCK_PREFILL_MS_PER_TOKEN"),
    ],
)
def test_mock_engine_flags_out_of_range_are_usage_errors(argv, env, message, capsys):
    with pytest.raises(SystemExit) as e:
        load(["--model", "/m", *argv], env)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_server_ages_connections_out_with_a_grace_unless_told_not_to():
    from core.server import server_options

    options = dict(server_options(load(["--model", "m", "--max-connection-age-seconds", "60"], {})))
    assert options["grpc.max_connection_age_ms"] == 60_000
    assert options["grpc.max_connection_age_grace_ms"] == 3_600_000
    off = dict(server_options(load(["--model", "m"], {"TRELLIS_CORE_MAX_CONNECTION_AGE_SECONDS": "0"})))
    assert "grpc.max_connection_age_ms" not in off and "grpc.max_connection_age_grace_ms" not in off


def test_prefix_cache_flags():
    c = load(["--model", "/m"], {})
    assert (c.prefix_cache, c.prefix_cache_mib, c.prefix_cache_block_size) == (True, 1024, 16)
    c = load(["--model", "/m", "--no-prefix-cache", "--prefix-cache-mib", "0", "--prefix-cache-block-size", "32"], {})
    assert (c.prefix_cache, c.prefix_cache_mib, c.prefix_cache_block_size) == (False, 0, 32)
    assert load(["--model", "/m"], {"TRELLIS_CORE_PREFIX_CACHE": "false"}).prefix_cache is False
    assert load(["--model", "/m", "--prefix-cache-mib", "2.5"], {}).prefix_cache_mib == 2.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-cache-mib", "-1"], "must be a finite number >= 0"),
        (["--prefix-cache-mib", "lots"], "expected a number"),
        (["--prefix-cache-mib", "inf"], "must be a finite number >= 0"),
        (["--prefix-cache-block-size", "0"], "must be at least 1"),
    ],
)
def test_prefix_cache_flags_out_of_range_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        load(["--model", "/m", *argv], {})
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_served_model_names():
    c = load(["--model", "/m", "--model-name", "x", "--served-model-name", "a,b", "--served-model-name", "c"], {})
    assert (c.served_model_name, c.model_aliases) == ("a", ("b", "c"))
    assert load(["--model", "/m", "--model-name", "x"], {}).model_aliases == ()
