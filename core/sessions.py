"""Continue-generation sessions: token sequences kept between requests.

A session maps a client key (GenerateRequest.session_id; the WebSocket gateway uses each
prompt's request_id) to the whole token sequence of its last request (prompt and generated
tokens). The next request with the same key ignores its prompt and continues from that
sequence. The store is bounded by the total number of tokens it holds and by an idle TTL,
evicting least recently used sessions first. Tokens are kept, not KV tensors: re-prefill is
cheap on small models and TensorRT-LLM's KV block reuse makes it cheap on large ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    tokens: list[int]
    touched: float


class SessionStore:
    """LRU store of token sequences bounded by total tokens and idle TTL.

    Args:
        max_tokens: tokens held by all sessions together (> 0). A sequence longer than this
            is not stored.
        ttl_seconds: idle time after which a session expires.
        clock: monotonic clock in seconds (injectable for tests).

    A key in use by a running request is "busy": `acquire` refuses it until `release`.
    """

    def __init__(self, max_tokens: int, ttl_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.max_tokens = max_tokens
        self.ttl = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._total = 0
        self._busy: set[str] = set()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def total_tokens(self) -> int:
        """Tokens currently held."""
        self._expire()
        return self._total

    def acquire(self, key: str) -> list[int] | None:
        """Mark `key` busy and return its sequence (None when there is no live session).

        Raises:
            KeyError: the key is busy with another request.
        """
        if key in self._busy:
            raise KeyError(key)
        self._expire()
        self._busy.add(key)
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.touched = self._clock()
        self._entries.move_to_end(key)
        return list(entry.tokens)

    def release(self, key: str, tokens: list[int] | None) -> None:
        """Store the new sequence of `key` (None deletes the session) and clear its busy mark."""
        self._busy.discard(key)
        self._remove(key)
        if tokens is None or len(tokens) > self.max_tokens:
            return
        self._entries[key] = _Entry(list(tokens), self._clock())
        self._total += len(tokens)
        while self._total > self.max_tokens:
            oldest = next(iter(self._entries))
            self._remove(oldest)

    def get(self, key: str) -> list[int] | None:
        """The sequence of `key` without marking it busy (None if absent or expired)."""
        self._expire()
        entry = self._entries.get(key)
        return None if entry is None else list(entry.tokens)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._total -= len(entry.tokens)

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.touched < self.ttl:
                break
            self._remove(key)
