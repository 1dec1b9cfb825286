"""Incremental, UTF-8-safe detokenization of a growing token sequence.

Decoding each token on its own breaks multi-byte characters split across byte tokens (CJK,
emoji) and drops SentencePiece's leading spaces (TensorRT-LLM issues #2488/#2595, TGI
#131/#333). Instead, a window of the sequence is decoded and only its stable suffix is emitted:
the text of `ids[prefix:]` minus the text of `ids[prefix:read]`, and only when it does not end
in U+FFFD (an incomplete character). A few prompt tokens seed the window, so the first
generated token keeps its leading space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Args:
        decode: maps a token id sequence to text (with the request's special-token options).
        context_ids: the prompt (only its last CONTEXT_TOKENS ids are used as context).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly stable text ("" while a character is incomplete)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever text is still pending (an incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT) and not final:
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        return delta
