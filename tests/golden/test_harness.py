"""The golden harness itself (tests/golden/harness.py): the placeholder dialect, key order,
regeneration that keeps placeholders, and examples turned into shapes."""

from __future__ import annotations

import json

import pytest

from tests.golden import harness
from tests.golden.harness import match, regenerate, shape_of


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        ({"a": "<int>"}, {"a": 3}, True),
        ({"a": "<int>"}, {"a": True}, False),
        ({"a": "<int>"}, {"a": 3.0}, False),
        ({"a": "<number>"}, {"a": 3.5}, True),
        ({"a": "<number>"}, {"a": False}, False),
        ({"a": "<str>"}, {"a": ""}, True),
        ({"a": "<str>"}, {"a": None}, False),
        ({"a": "<bool>"}, {"a": 0}, False),
        ({"a": "<logprob>"}, {"a": 0.5}, False),
        ({"a": "<logprob>"}, {"a": -0.5}, True),
        ({"a": "<logprob>"}, {"a": 0}, True),
        ({"a": "<token_id>"}, {"a": -1}, False),
        ({"a": "<token_id>"}, {"a": 0}, True),
        ({"a": "<any>"}, {"a": [None]}, True),
        ({"a": "<one_of:stop|length>"}, {"a": "length"}, True),
        ({"a": "<one_of:stop|length>"}, {"a": "eos"}, False),
        ({"a": "<one_of:stop|length>"}, {"a": None}, False),
        ({"a": "<one_of:stop|null>"}, {"a": None}, True),
        ({"a": "<|eos|>"}, {"a": "<|eos|>"}, True),  # not a placeholder: a token text
        ({"a": "<|eos|>"}, {"a": "x"}, False),
        ({"a": 1, "b?": True}, {"a": 1}, True),
        ({"a": 1, "b?": True}, {"a": 1, "b": False}, False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),  # key order is part of the answer
        (["<each:2>", "<str>"], ["x", "y"], True),
        (["<each:2>", "<str>"], ["x"], False),
        (["<each>", "<str>"], [], True),
        (["<each>", "<str>"], ["x", 1], False),
        ([1, 2], [1, 2, 3], False),
        ({"a": None}, {"a": None}, True),
        ({"a": 0}, {"a": False}, False),
        ({"a": 1}, {"a": 1.0}, False),
    ],
)
def test_matcher(expected, actual, ok):
    if ok:
        match(expected, actual)
    else:
        with pytest.raises(AssertionError):
            match(expected, actual)


def test_a_mismatch_names_the_place():
    with pytest.raises(AssertionError, match=r"\$\.a\[1\]\.b: expected 2, got 3"):
        match({"a": [{"b": 1}, {"b": 2}]}, {"a": [{"b": 1}, {"b": 3}]})


def test_regenerate_keeps_what_still_matches():
    expected = {"text": "<str>", "n?": 1, "tokens": ["<each>", "<token_id>"], "reason": "length", "gone": 1}
    actual = {"text": "new", "n": 2, "tokens": [1, 2], "reason": "stop", "added": True}
    assert regenerate(expected, actual) == {
        "text": "<str>",
        "n?": 2,
        "tokens": ["<each>", "<token_id>"],
        "reason": "stop",
        "added": True,
    }
    assert regenerate(None, {"a": 1}) == {"a": 1}
    assert regenerate([1, "<str>"], [2, "x"]) == [2, "<str>"]


def test_check_rewrites_the_file_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "case.json"
    case = {"input": 1, "expected": {"text": "<str>", "count": 1}}
    path.write_text(json.dumps(case))
    with pytest.raises(AssertionError):
        harness.check(path, json.loads(path.read_text()), {"expected": {"text": "x", "count": 2}})
    assert json.loads(path.read_text()) == case
    monkeypatch.setattr(harness, "UPDATE", True)
    harness.check(path, json.loads(path.read_text()), {"expected": {"text": "x", "count": 2}})
    assert json.loads(path.read_text()) == {"input": 1, "expected": {"text": "<str>", "count": 2}}


def test_shape_of_an_example():
    example = {"id": "x", "n": 3, "lp": -0.5, "t": 2.5, "ok": True, "none": None, "items": [{"a": 1}], "empty": []}
    assert shape_of(example) == {
        "id": "<str>",
        "n": "<token_id>",
        "lp": "<logprob>",
        "t": "<number>",
        "ok": True,
        "none": None,
        "items": ["<each>", {"a": "<token_id>"}],
        "empty": [],
    }
    match(shape_of(example), {**example, "id": "y", "lp": -3, "items": [{"a": 7}, {"a": 0}]})
