"""Continue-generation sessions: token sequences kept between requests.

A session maps a key (`session_key`: GenerateRequest.session_id, scoped to its caller; the
WebSocket gateway uses each prompt's request_id) to the whole token sequence of its last request
(prompt and generated tokens). The next request with the same key ignores its prompt and
continues from that sequence. The store is bounded by the total number of tokens it holds, by
the bytes it holds (keys and token arrays), and by an idle TTL, evicting least recently used
sessions first. Tokens are kept, not KV tensors: re-prefill is cheap on small models and
TensorRT-LLM's KV block reuse makes it cheap on large ones.

Tenancy: the key holds the caller's scope (core.convert: the identity of the call's API key
when the core has keys, and the tenant a gateway names), so a caller with another key neither
reads nor extends a session whatever id it sends. Without keys and tenants, the id is the only
secret: whoever sends it continues the session.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes an entry costs beyond its key and tokens (the entry, its OrderedDict slot, the
#: array header), so that many tiny sessions count too.
ENTRY_OVERHEAD = 200


def session_key(session_id: str, scope: str) -> str:
    """The store's key of `session_id` for a caller of `scope` ("" : no scope, the id alone)."""
    return f"{scope}\0{session_id}" if scope else session_id


@dataclass(slots=True)
class _Entry:
    tokens: array[int]
    touched: float
    cost: int  # bytes (SessionStore.max_bytes)


class SessionStore:
    """LRU store of token sequences bounded by total tokens, total bytes and idle TTL.

    Args:
        max_tokens: tokens held by all sessions together (> 0). A sequence longer than this
            is not stored.
        ttl_seconds: idle time after which a session expires.
        clock: monotonic clock in seconds (injectable for tests).
        max_bytes: bytes held by all sessions together: each key's UTF-8 bytes, 4 per token
            and ENTRY_OVERHEAD. An entry larger than this is not stored.

    A key in use by a running request is "busy": `acquire` refuses it until `release`.
    """

    def __init__(
        self,
        max_tokens: int,
        ttl_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = 256 * 1024 * 1024,
    ):
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.ttl = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._total = 0
        self._bytes = 0
        self._busy: set[str] = set()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def total_tokens(self) -> int:
        """Tokens currently held."""
        self._expire()
        return self._total

    @property
    def total_bytes(self) -> int:
        """Bytes currently held (see `max_bytes`)."""
        self._expire()
        return self._bytes

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
        stored = array("i", tokens)
        cost = len(key.encode("utf-8", "surrogatepass")) + stored.itemsize * len(stored) + ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return
        self._entries[key] = _Entry(stored, self._clock(), cost)
        self._total += len(tokens)
        self._bytes += cost
        while self._total > self.max_tokens or self._bytes > self.max_bytes:
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
            self._bytes -= entry.cost

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.touched < self.ttl:
                break
            self._remove(key)
