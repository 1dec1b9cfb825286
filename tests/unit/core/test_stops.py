"""Stop strings matched on text: across deltas, inside a token, with hold-back."""

from __future__ import annotations

import pytest

from core.stops import StopMatcher


def feed(stops, deltas, include=False):
    m = StopMatcher(stops, include)
    out = []
    for d in deltas:
        r = m.push(d)
        out.append(r.text)
        if r.stop is not None:
            return out, r.stop
    out.append(m.flush())
    return out, None


@pytest.mark.parametrize(
    "stops, deltas, include, expected_text, expected_stop",
    [
        (["END"], ["hello ", "world"], False, "hello world", None),
        (["END"], ["abc E", "ND tail"], False, "abc ", "END"),  # across two deltas
        (["END"], ["abc E", "ND tail"], True, "abc END", "END"),
        (["\n\n"], ["line\n", "\nnext"], False, "line", "\n\n"),
        (["lo w"], ["hello world"], False, "hel", "lo w"),  # ends inside a token
        (["x", "xyz"], ["axyz"], False, "a", "xyz"),  # same start: the longer wins
        (["bc", "abc"], ["zabc"], False, "z", "abc"),  # the earliest start wins
        (["END"], ["EN", "D"], False, "", "END"),
        (["END"], ["E", "x"], False, "Ex", None),  # partial match ruled out, released
        ([], ["anything"], False, "anything", None),
    ],
)
def test_stop_matching(stops, deltas, include, expected_text, expected_stop):
    out, stop = feed(stops, deltas, include)
    assert "".join(out) == expected_text
    assert stop == expected_stop


def test_hold_back_never_streams_a_possible_stop_prefix():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST").text == "abc "
    assert m.held == "ST"
    assert m.push("O").text == ""
    assert m.held == "STO"
    r = m.push("RM")
    assert (r.text, r.stop) == ("STORM", None)
    assert m.held == ""


def test_hold_back_keeps_only_the_longest_candidate():
    m = StopMatcher(["aab"])
    assert m.push("xaa").text == "x"
    assert m.push("a").text == "a"  # "aaa": only the last "aa" can still start "aab"
    assert m.held == "aa"


def test_flush_releases_held_text():
    m = StopMatcher(["</s>"])
    assert m.push("end</").text == "end"
    assert m.flush() == "</"
