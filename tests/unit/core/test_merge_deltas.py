"""Coalescing of the deltas that wait for a slow Generate reader (core.pipeline.merge_deltas)."""

from __future__ import annotations

from core.pipeline import merge_deltas
from core.types import FinalInfo, FinishReason, RequestState, ResponseDelta, SequenceDelta, Timing, TokenInfo, Usage


def tok(i: int) -> TokenInfo:
    return TokenInfo(i, f"t{i}", f"t{i}".encode(), False, -0.5)


def text_delta(index: int, text: str, ids: list[int], **kw) -> ResponseDelta:
    return ResponseDelta(sequences=[SequenceDelta(index, text, [tok(i) for i in ids], **kw)])


FINAL = FinalInfo(Usage(3, 4), 7, None, Timing(1.0, 2.0, 3.0))  # type: ignore[arg-type]


def test_lifecycle_deltas_keep_their_own_messages_in_order():
    states = [ResponseDelta(state=s) for s in (RequestState.QUEUED, RequestState.SCHEDULED, RequestState.PREFILLED)]
    assert merge_deltas(states) == states


def test_token_deltas_merge_into_the_generating_one_and_keep_every_token_and_the_finish():
    first = text_delta(0, "a", [1])
    first.state = RequestState.GENERATING
    last = text_delta(0, "c", [3], finish_reason=FinishReason.LENGTH, cumulative_logprob=-1.5)
    last.final = FINAL
    merged = merge_deltas([ResponseDelta(state=RequestState.PREFILLED), first, text_delta(0, "b", [2]), last])
    assert [d.state for d in merged] == [RequestState.PREFILLED, RequestState.GENERATING]
    seq = merged[1].sequences[0]
    assert (seq.text, [t.id for t in seq.tokens]) == ("abc", [1, 2, 3])
    assert (seq.finish_reason, seq.cumulative_logprob, merged[1].final) == (FinishReason.LENGTH, -1.5, FINAL)


def test_sequences_merge_by_index_and_new_ones_are_appended():
    merged = merge_deltas([text_delta(1, "x", [5]), text_delta(0, "y", [6]), text_delta(1, "z", [7])])
    assert [(s.index, s.text, [t.id for t in s.tokens]) for s in merged[0].sequences] == [
        (1, "xz", [5, 7]),
        (0, "y", [6]),
    ]


def test_nothing_merges_after_the_final_delta():
    done = text_delta(0, "a", [1])
    done.final = FINAL
    later = text_delta(0, "b", [2])
    assert merge_deltas([done, later]) == [done, later]
