"""The settings parser both islands share (envflags): flags with environment fallbacks, and the
one true/false vocabulary."""

from __future__ import annotations

import argparse

import pytest

from envflags import EnvArgumentParser, parse_bool


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off ", False),
        ("", None),
        ("   ", None),
    ],
)
def test_parse_bool(raw, value):
    assert parse_bool(raw) is value


@pytest.mark.parametrize("raw", ["maybe", "2", "y", "t", "none"])
def test_parse_bool_refuses_other_words(raw):
    with pytest.raises(ValueError, match="expected a boolean"):
        parse_bool(raw)


def _parser(environ: dict[str, str]) -> EnvArgumentParser:
    p = EnvArgumentParser(prog="t", env_prefix="T_", environ=environ)
    p.add_argument("--on-by-default", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--flag", action=argparse.BooleanOptionalAction, default=False, env_aliases=("OTHER_FLAG",))
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--name", default="x")
    return p


@pytest.mark.parametrize(
    ("environ", "argv", "expected"),
    [
        ({}, [], (True, False, 1, "x")),
        ({"T_ON_BY_DEFAULT": "off", "T_FLAG": "yes", "T_COUNT": "3", "T_NAME": "y"}, [], (False, True, 3, "y")),
        # An empty boolean is not set: the default stays (a template's empty value flips nothing).
        ({"T_ON_BY_DEFAULT": "", "T_FLAG": " "}, [], (True, False, 1, "x")),
        # A string option takes "" as its value.
        ({"T_NAME": ""}, [], (True, False, 1, "")),
        # The prefixed variable comes first, then the aliases; the command line wins over both.
        ({"OTHER_FLAG": "true"}, [], (True, True, 1, "x")),
        ({"OTHER_FLAG": "true", "T_FLAG": "false"}, [], (True, False, 1, "x")),
        ({"OTHER_FLAG": "true", "T_FLAG": ""}, [], (True, True, 1, "x")),
        ({"T_FLAG": "true", "T_COUNT": "3"}, ["--no-flag", "--count", "4"], (True, False, 4, "x")),
    ],
)
def test_environment_fallbacks(environ, argv, expected):
    ns = _parser(environ).parse_args(argv)
    assert (ns.on_by_default, ns.flag, ns.count, ns.name) == expected


@pytest.mark.parametrize("environ", [{"T_FLAG": "maybe"}, {"OTHER_FLAG": "2"}, {"T_COUNT": "many"}])
def test_malformed_values_are_usage_errors_naming_the_variable(environ, capsys):
    with pytest.raises(SystemExit) as e:
        _parser(environ).parse_args([])
    assert e.value.code == 2
    assert next(iter(environ)) in capsys.readouterr().err


def test_help_names_the_variables(capsys):
    p = EnvArgumentParser(prog="t", env_prefix="T_", environ={})
    p.add_argument("--flag", action=argparse.BooleanOptionalAction, default=False, env_aliases=("OTHER",), help="h")
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    assert "[env T_FLAG, OTHER]" in capsys.readouterr().out


def test_api_keys_may_be_named():
    from envflags.apikeys import ApiKeys, split_named

    keys = ApiKeys(["alice:k-1:with-colon", "plain"])
    assert keys.named
    assert keys.check("Bearer k-1:with-colon") is None and keys.check("Bearer plain") is None
    assert keys.name_of("Bearer k-1:with-colon") == "alice"
    assert keys.name_of("Bearer plain") is None
    assert keys.name_of("Bearer wrong") is None and keys.name_of(None) is None
    assert not ApiKeys(["plain"]).named
    assert split_named("plain") == (None, "plain")
    for bad in (":key", "name:"):
        with pytest.raises(ValueError, match="NAME:KEY"):
            split_named(bad)
