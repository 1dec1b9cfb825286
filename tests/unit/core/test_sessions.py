"""The continue-generation store: LRU by total tokens, idle TTL, busy keys."""

from __future__ import annotations

import pytest

from core.sessions import SessionStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_acquire_release_round_trip():
    s = SessionStore(100, 60)
    assert s.acquire("a") is None
    s.release("a", [1, 2, 3])
    assert s.acquire("a") == [1, 2, 3]
    s.release("a", [1, 2, 3, 4])
    assert s.get("a") == [1, 2, 3, 4] and s.total_tokens == 4


def test_release_none_deletes():
    s = SessionStore(100, 60)
    s.acquire("a")
    s.release("a", [1])
    s.acquire("a")
    s.release("a", None)
    assert s.get("a") is None and len(s) == 0 and s.total_tokens == 0


def test_busy_key_is_refused_until_released():
    s = SessionStore(100, 60)
    s.acquire("a")
    with pytest.raises(KeyError):
        s.acquire("a")
    s.release("a", [1])
    assert s.acquire("a") == [1]


def test_least_recently_used_sessions_are_evicted_past_the_token_bound():
    s = SessionStore(10, 60)
    for key, n in (("a", 4), ("b", 4)):
        s.acquire(key)
        s.release(key, list(range(n)))
    s.acquire("a")  # touch a: b is now the least recently used
    s.release("a", list(range(4)))
    s.acquire("c")
    s.release("c", list(range(4)))
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None
    assert s.total_tokens == 8


def test_a_sequence_longer_than_the_bound_is_not_stored():
    s = SessionStore(5, 60)
    s.acquire("a")
    s.release("a", list(range(6)))
    assert s.get("a") is None and s.total_tokens == 0


def test_idle_sessions_expire():
    clock = Clock()
    s = SessionStore(100, 10, clock=clock)
    s.acquire("a")
    s.release("a", [1])
    clock.now = 9.9
    assert s.get("a") == [1]
    clock.now = 10.0
    assert s.get("a") is None and s.total_tokens == 0
