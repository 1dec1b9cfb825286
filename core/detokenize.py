"""Incremental, UTF-8-safe detokenization of a growing token sequence.

Decoding each token on its own breaks multi-byte characters split across byte tokens (CJK,
emoji) and drops SentencePiece's leading spaces (TensorRT-LLM issues #2488/#2595, TGI
#131/#333). Instead, a window of the sequence is decoded and only its stable suffix is emitted:
the text of `ids[prefix:]` minus the text of `ids[prefix:read]`, and only when it does not end
in U+FFFD (an incomplete character). A few prompt tokens seed the window, so the first
generated token keeps its leading space.

Where the tokenizer decodes exactly by concatenating the tokens' bytes (byte-level BPE,
`Tokenizer.byte_exact`), `ByteDetokenizer` streams the same text without decoding windows: an
incremental UTF-8 decoder over the tokens' bytes holds back an incomplete character, and a
token costs a dictionary look-up instead of two tokenizer calls.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

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


class Detokenizer(Protocol):
    """Turns a stream of token ids into text deltas (what the request pipeline uses)."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly stable text."""
        ...

    def flush(self) -> str:
        """Return whatever text is still pending (an incomplete character becomes U+FFFD)."""
        ...


class ByteDetokenizer:
    """Incremental detokenization for byte-exact tokenizers (`Tokenizer.byte_exact`).

    The text of a sequence is its tokens' bytes (special tokens left out when skipped) decoded
    as UTF-8, invalid bytes replaced by U+FFFD: what tokenizers' ByteLevel decoder does
    (`String::from_utf8_lossy`, which replaces each maximal invalid subpart by one U+FFFD, as
    Python's UTF-8 decoder does). Text is streamed as soon as its characters are complete; an
    incomplete one waits for the next token (tests/unit/core/test_detokenize.py checks the
    equality with the tokenizer's decode over many sequences).

    Args:
        token_bytes: maps a token id to its raw bytes.
        skip: ids left out of the text (the special tokens, under skip_special_tokens).
        texts: the text of each token whose bytes are whole UTF-8 on their own, filled as such
            tokens are seen; one dict may serve every detokenizer of a tokenizer, so a token
            that follows whole characters costs one look-up.
    """

    def __init__(
        self, token_bytes: Callable[[int], bytes], skip: Collection[int] = (), texts: dict[int, str] | None = None
    ):
        self._bytes = token_bytes
        self._skip = skip
        self._texts: dict[int, str] = {} if texts is None else texts
        self._held = b""  # the bytes of an incomplete character

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text ("" while a character is incomplete)."""
        skip, to_bytes = self._skip, self._bytes
        if len(token_ids) == 1:
            tok = token_ids[0]
            if tok in skip:
                return ""
            if not self._held:
                text = self._texts.get(tok)
                if text is not None:
                    return text
                data = to_bytes(tok)
                text, used = codecs.utf_8_decode(data, "replace", False)
                if used == len(data):
                    self._texts[tok] = text
                else:
                    self._held = data[used:]
                return text
            data = self._held + to_bytes(tok)
        else:
            data = self._held + b"".join(to_bytes(t) for t in token_ids if t not in skip)
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def flush(self) -> str:
        """Return an incomplete trailing character as U+FFFD ("" when there is none)."""
        held, self._held = self._held, b""
        return codecs.utf_8_decode(held, "replace", True)[0]
