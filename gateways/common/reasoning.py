"""Reasoning output: the text a model writes between `<think>` and `</think>` before its answer,
told apart from the answer as it streams (pure: text in, text out).

Parsers, by vLLM's names for them (`vllm/reasoning/`, `--reasoning-parser`, vLLM 0.11):
  * "deepseek_r1": the output starts in reasoning (DeepSeek-R1's chat template opens `<think>`
    in the prompt); a `<think>` at the very start of the output is dropped; everything up to
    the first `</think>` is reasoning, the rest is content. An output that never closes the
    block is all reasoning, as vLLM's DeepSeekR1ReasoningParser reads it.
  * "qwen3": reasoning only when the output opens with `<think>` (leading whitespace allowed);
    then up to the first `</think>` is reasoning and the rest content. An output that does not
    open with `<think>` is all content. A block cut short (max_tokens) stays reasoning, so that
    what was streamed as reasoning is also what a non-streamed response calls reasoning.

Tags may be split across deltas in any way ("<th" + "ink>"): the parser holds back the
shortest tail that could still become a tag, and gives it out as soon as it cannot. Only the
first block counts; tags after it are content. `ReasoningParser.feed` takes each text delta
and returns `(reasoning, content)`; `finish` returns what was held back at the end of the
output.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"

#: The parsers' names (`--reasoning-parser`), each with whether an output starts in reasoning.
PARSERS: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}

_OPENING, _REASONING, _CONTENT = 0, 1, 2


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningParser:
    """Reasoning and content of one output (one choice), fed delta by delta.

    Args:
        starts_in_reasoning: the output is reasoning until `</think>` even without `<think>`
            ("deepseek_r1"); else only an opening `<think>` starts reasoning ("qwen3").
    """

    starts_in_reasoning: bool
    _state: int = _OPENING
    _held: str = ""

    @classmethod
    def named(cls, name: str) -> ReasoningParser:
        """The parser called `name` (a key of PARSERS).

        Raises:
            KeyError: an unknown name.
        """
        return cls(PARSERS[name])

    @property
    def done(self) -> bool:
        """Whether the reasoning section is over (or never opened): `feed` then gives every
        text back as content, unchanged, and `finish` gives nothing."""
        return self._state == _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """`(reasoning, content)` of the next delta of the output (either may be "")."""
        text = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == _OPENING:
            stripped = text.lstrip()
            if stripped.startswith(START):
                text = stripped[len(START) :]
                self._state = _REASONING
            elif START.startswith(stripped):  # still possibly an opening tag ("" too)
                self._held = text
                return "", ""
            else:
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            end = text.find(END)
            if end < 0:
                keep = _partial(text, END)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END) :]
            self._state = _CONTENT
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """`(reasoning, content)` held back at the end of the output: a partial tag is text."""
        held, self._held = self._held, ""
        if self._state == _OPENING:
            if not held:
                return "", ""
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """`(reasoning, content)` of a whole output (`feed` then `finish`)."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
