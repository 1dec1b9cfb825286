"""Generation defaults "from .env" (gateways.ws.config): file, environment precedence, parse
errors, the --env-file default, and the gateway's flags with their env fallbacks."""

import pytest

from gateways.common.config import GatewayConfig, load
from gateways.ws import DEFAULT_PORT, add_arguments, make_app
from gateways.ws.config import load_generation_defaults, load_settings, resolve_env_file

FULL = """\
# the original project's names
MODEL_DEFAULT_NUM_BEAMS = 1
MODEL_DEFAULT_DO_SAMPLE = true
MODEL_DEFAULT_TEMPERATURE = 0.7
MODEL_DEFAULT_TOP_P = 0.9
MODEL_DEFAULT_TOP_K = 50
MODEL_DEFAULT_MAX_NEW_TOKENS = 64
MODEL_DEFAULT_REPETITION_PENALTY = 1.1
MODEL_DEFAULT_LENGTH_PENALTY = 1
MODEL_PATH = /ignored/here
"""


def _write(tmp_path, text):
    path = tmp_path / ".env"
    path.write_text(text)
    return str(path)


def test_every_field_from_the_file(tmp_path):
    cfg = load_generation_defaults(_write(tmp_path, FULL), {})
    assert cfg.model_dump() == {
        "num_beams": 1,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "max_new_tokens": 64,
        "repetition_penalty": 1.1,
        "length_penalty": 1.0,
    }


def test_nothing_set_leaves_every_field_to_the_core(tmp_path):
    assert load_generation_defaults(None, {}).model_dump(exclude_none=True) == {}
    assert (
        load_generation_defaults(_write(tmp_path, "OTHER=1\nMODEL_DEFAULT_TOP_K=\n"), {}).model_dump(exclude_none=True)
        == {}
    )


def test_the_process_environment_wins_over_the_file(tmp_path):
    environ = {"MODEL_DEFAULT_MAX_NEW_TOKENS": "8", "MODEL_DEFAULT_DO_SAMPLE": "0", "UNRELATED": "x"}
    cfg = load_generation_defaults(_write(tmp_path, FULL), environ)
    assert cfg.max_new_tokens == 8 and cfg.do_sample is False and cfg.top_k == 50


@pytest.mark.parametrize(
    "line, message",
    [
        ("MODEL_DEFAULT_TOP_K=many", "MODEL_DEFAULT_TOP_K='many': expected an integer"),
        ("MODEL_DEFAULT_TEMPERATURE=warm", "MODEL_DEFAULT_TEMPERATURE='warm': expected a number"),
        ("MODEL_DEFAULT_DO_SAMPLE=maybe", "MODEL_DEFAULT_DO_SAMPLE='maybe': expected a boolean (1/0, true/false"),
        ("MODEL_DEFAULT_MAX_NEW_TOKENS=99999999999", "MODEL_DEFAULT_MAX_NEW_TOKENS='99999999999': must fit"),
    ],
)
def test_malformed_values_name_the_variable(tmp_path, line, message):
    with pytest.raises(ValueError) as info:
        load_generation_defaults(_write(tmp_path, line + "\n"), {})
    assert str(info.value).startswith(message)


def test_a_missing_env_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_generation_defaults(str(tmp_path / "absent.env"), {})


def test_env_file_resolution(tmp_path):
    assert resolve_env_file(None, cwd=tmp_path) is None
    (tmp_path / ".env").write_text("MODEL_DEFAULT_TOP_K=3\n")
    assert resolve_env_file(None, cwd=tmp_path) == str(tmp_path / ".env")
    assert resolve_env_file("", cwd=tmp_path) is None
    assert resolve_env_file("/x/y.env", cwd=tmp_path) == "/x/y.env"


def test_flags_and_their_env_fallbacks(tmp_path):
    env_file = _write(tmp_path, "MODEL_DEFAULT_TOP_K=3\n")
    config = load(
        "ws",
        DEFAULT_PORT,
        add_arguments,
        ["--max-prompts-per-batch", "8", "--env-file", env_file],
        {"TRELLIS_GATEWAY_MAX_FRAME_BYTES": "4096", "TRELLIS_GATEWAY_HEARTBEAT_SECONDS": "0"},
    )
    assert config.port == 8765
    settings = load_settings(config, environ={"MODEL_DEFAULT_TEMPERATURE": "0.5"})
    assert settings.max_prompts_per_batch == 8
    assert settings.max_frame_bytes == 4096
    assert settings.heartbeat_seconds == 0
    assert settings.max_in_flight_prompts == 256
    assert settings.env_file == env_file
    assert settings.defaults.model_dump(exclude_none=True) == {"top_k": 3, "temperature": 0.5}


def test_make_app_refuses_a_bad_env_file(tmp_path):
    env_file = _write(tmp_path, "MODEL_DEFAULT_NUM_BEAMS=two\n")
    with pytest.raises(ValueError, match="MODEL_DEFAULT_NUM_BEAMS"):
        make_app(GatewayConfig(name="ws", options={"env_file": env_file}))
