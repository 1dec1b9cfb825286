"""Stop strings matched on decoded text, with hold-back while streaming.

Token-level matching misses stop strings that tokenize differently in context (TensorRT-LLM
#90/#228, tensorrtllm_backend #47) and stops only at token boundaries (TGI #1979), so stop
strings are matched on the detokenized text here, once, for every engine. While streaming,
text that could still be the beginning of a stop string is held back (never streamed) until it
either completes a match or is ruled out; a match may end inside a token, and the text is cut
exactly there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Result of feeding text: what may be emitted now, and the stop string that matched."""

    text: str
    stop: str | None = None


class StopMatcher:
    """Matches stop strings across text deltas of one sequence.

    Args:
        stops: the stop strings (non-empty strings; an empty list disables matching).
        include_stop: keep the matched stop string at the end of the emitted text.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._held = ""

    @property
    def held(self) -> str:
        """Text received but not yet released."""
        return self._held

    def push(self, text: str) -> StopMatch:
        """Feed a text delta. Returns the releasable text, and the stop string if one matched
        (the sequence then ends; later input must not be pushed)."""
        if not self._stops:
            return StopMatch(text)
        buf = self._held + text
        best_at, best_stop = -1, None
        for s in self._stops:
            at = buf.find(s)
            if at >= 0 and (best_stop is None or at < best_at or (at == best_at and len(s) > len(best_stop))):
                best_at, best_stop = at, s
        if best_stop is not None:
            self._held = ""
            end = best_at + (len(best_stop) if self._include else 0)
            return StopMatch(buf[:end], best_stop)
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return StopMatch(buf[: len(buf) - keep])

    def flush(self) -> str:
        """Release the held text (the sequence ended without a match)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
