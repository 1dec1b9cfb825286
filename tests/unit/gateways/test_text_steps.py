"""The gateway's stream reader hands each request its entries of a message's TextSteps
(generate_service.proto) as the event's `texts`, `token_ids` and `logprobs` would be: a
request's several entries (steps the core sent together while the gateway was behind) in one
call and in order, -1 and NaN read as "no token" and "no logprob", entries of a request no
longer open skipped, and a request whose rendering fails cancelled without costing the
others their entries."""

from __future__ import annotations

import math

import pytest
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_client import CoreCall, _Multiplexed

NAN = math.nan


class Listened:
    """A CoreCall as a relay listens to it: every listener call recorded, the cancels counted."""

    def __init__(self, rid: int, fail: bool = False, entry: bool = False):
        self.got: list[tuple[list[str], list[int], list[float]]] = []
        self.entries: list[tuple[str, int | None, float | None]] = []
        self.cancels = 0
        self.fail = fail
        self.call = CoreCall(spb.GenerateRequest(request_id=f"r{rid}"), self._cancel)
        self.call.listen(lambda: None)
        self.call.listen_texts(self._texts, self._entry if entry else None)

    def _texts(self, texts, token_ids, logprobs) -> None:
        if self.fail:
            raise RuntimeError("a rendering bug")
        self.got.append((list(texts), list(token_ids), list(logprobs)))

    def _entry(self, text, token_id, logprob) -> None:
        if self.fail:
            raise RuntimeError("a rendering bug")
        self.entries.append((text, token_id, logprob))

    def _cancel(self) -> None:
        self.cancels += 1


def steps(*entries: tuple[int, str, int, float], columns: bool = True) -> spb.TextSteps:
    """TextSteps of (id, text, token id, logprob) entries; without `columns` only ids and texts."""
    out = spb.TextSteps(ids=[e[0] for e in entries], texts=[e[1] for e in entries])
    if columns:
        out.token_ids.extend(e[2] for e in entries)
        out.logprobs.extend(e[3] for e in entries)
    return out


def take(msg: spb.TextSteps, *calls: Listened) -> None:
    _Multiplexed._take_steps(
        spb.TextSteps.FromString(msg.SerializeToString()), {i + 1: c.call for i, c in enumerate(calls)}
    )


def test_each_entry_reaches_its_request_with_its_columns():
    plain, compact, no_logprob = Listened(1), Listened(2), Listened(3)
    take(steps((1, "a", -1, NAN), (2, "b", 7, -0.5), (3, "", 9, NAN), (4, "gone", -1, NAN)), plain, compact, no_logprob)
    assert plain.got == [(["a"], [], [])]
    assert compact.got == [(["b"], [7], [-0.5])]
    assert no_logprob.got == [([""], [9], [])]


def test_plain_entries_without_token_columns():
    one, two = Listened(1), Listened(2)
    take(steps((2, "x", 0, 0.0), (1, "y", 0, 0.0), columns=False), one, two)
    assert (one.got, two.got) == ([(["y"], [], [])], [(["x"], [], [])])


@pytest.mark.parametrize("columns", [True, False])
def test_a_requests_several_entries_arrive_together_in_order(columns):
    one, two, three = Listened(1), Listened(2), Listened(3)
    entries = [(1, "a", 1, -1.0), (2, "p", 5, -0.1), (1, "b", 2, -2.0), (2, "q", 6, -0.2), (1, "c", 3, -3.0)]
    entries += [(3, "z", 8, -0.3)]
    take(steps(*entries, columns=columns), one, two, three)
    if columns:
        assert one.got == [(["a", "b", "c"], [1, 2, 3], [-1.0, -2.0, -3.0])]
        assert two.got == [(["p", "q"], [5, 6], [pytest.approx(-0.1), pytest.approx(-0.2)])]
        assert three.got == [(["z"], [8], [pytest.approx(-0.3)])]
    else:
        assert (one.got, two.got, three.got) == ([(["a", "b", "c"], [], [])], [(["p", "q"], [], [])], [(["z"], [], [])])


@pytest.mark.parametrize("grouped", [False, True])
def test_a_failing_renderer_cancels_its_request_only(grouped):
    ok, bad = Listened(1), Listened(2, fail=True)
    entries = [(1, "a", -1, NAN), (2, "b", -1, NAN)] + ([(1, "c", -1, NAN)] if grouped else [])
    take(steps(*entries), ok, bad)
    assert ok.got == [(["a", "c"] if grouped else ["a"], [], [])]
    assert (bad.cancels, bad.call.ended, ok.cancels) == (1, True, 0)


def test_an_entry_listener_takes_a_requests_one_entry_as_values():
    plain, compact, no_logprob = (Listened(i, entry=True) for i in (1, 2, 3))
    take(steps((1, "a", -1, NAN), (2, "b", 7, -0.5), (3, "", 9, NAN)), plain, compact, no_logprob)
    assert plain.entries == [("a", None, None)]
    assert (compact.entries, no_logprob.entries) == ([("b", 7, -0.5)], [("", 9, None)])
    assert (plain.got, compact.got, no_logprob.got) == ([], [], [])
    # A message where a request has several entries hands each request its entries as lists.
    take(steps((1, "x", -1, NAN), (2, "y", 8, -1.0), (2, "z", 9, -2.0)), plain, compact, no_logprob)
    assert (plain.got, compact.got, len(plain.entries)) == ([(["x"], [], [])], [(["y", "z"], [8, 9], [-1.0, -2.0])], 1)


def test_a_failing_entry_listener_cancels_its_request_only():
    ok, bad = Listened(1, entry=True), Listened(2, fail=True, entry=True)
    take(steps((1, "a", -1, NAN), (2, "b", -1, NAN)), ok, bad)
    take(steps((1, "c", -1, NAN), (2, "d", -1, NAN)), ok, bad)
    assert ok.entries == [("a", None, None), ("c", None, None)]
    assert (bad.entries, bad.cancels, bad.call.ended, ok.cancels) == ([], 1, True, 0)


def test_a_request_without_a_text_listener_gets_the_messages_they_stand_for():
    call = CoreCall(spb.GenerateRequest(request_id="r1"), lambda: None)
    _Multiplexed._take_steps(steps((1, "a", 4, -0.25), (1, "b", 5, -0.5)), {1: call})
    got = [(m.request_id, m.outputs[0].text, [(t.id, t.logprob) for t in m.outputs[0].tokens]) for m in call.take()]
    assert got == [("r1", "a", [(4, -0.25)]), ("r1", "b", [(5, -0.5)])]
