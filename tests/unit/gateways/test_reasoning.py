"""The reasoning parsers (gateways.common.reasoning): `<think>` blocks told apart from content,
fed whole and in every possible split, so tags cut across deltas are still found."""

from __future__ import annotations

import itertools

import pytest

from gateways.common.reasoning import PARSERS, ReasoningParser


def fed(name: str, pieces: list[str]) -> tuple[str, str]:
    """Reasoning and content of `pieces` fed one by one, then finished."""
    parser = ReasoningParser.named(name)
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


def splits(text: str, cuts: int = 2):
    """`text` cut at every combination of `cuts` positions."""
    for points in itertools.combinations(range(1, len(text)), cuts):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>plan</think>answer", "plan", "answer"),
    ("qwen3", "\n<think>a<b</think>\n\nok", "a<b", "\n\nok"),
    ("qwen3", "no think here", "", "no think here"),
    ("qwen3", "x<think>y</think>z", "", "x<think>y</think>z"),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "<think></think>", "", ""),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "all reasoning", "all reasoning", ""),
    ("deepseek_r1", "ends in </thin", "ends in </thin", ""),
    ("deepseek_r1", "</think>", "", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_and_every_split_agree(name, text, reasoning, content):
    assert ReasoningParser.named(name).split(text) == (reasoning, content)
    for pieces in [list(text), *splits(text)]:
        assert fed(name, pieces) == (reasoning, content), pieces


def test_reasoning_streams_before_the_block_closes():
    parser = ReasoningParser.named("qwen3")
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>ab") == ("ab", "")
    assert parser.feed("c</") == ("c", "")  # "</" may begin the end tag: held
    assert parser.feed("x") == ("</x", "")  # it did not
    assert parser.feed("</think>d") == ("", "d")
    assert parser.feed("<think>") == ("", "<think>")


def test_names_are_vllms():
    assert set(PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(KeyError):
        ReasoningParser.named("granite")
