"""The prefix cache's block store (core.engine.hf_prefix.PrefixStore), on plain payloads: chained
lookups of full blocks, the cap that leaves a prompt's last token to compute, LRU eviction
within the bound (tails before heads), what `insert` asks `copy_out` for, and the counters."""

from __future__ import annotations

import pytest

from core.engine.hf_prefix import PrefixStore
from core.types import PrefixCacheStats


def payloads(tokens: list[int], bs: int = 4):
    """A copy_out that names each block by its first token and its index, recording its calls."""
    calls: list[tuple[int, int]] = []

    def copy_out(first: int, count: int) -> list[str]:
        calls.append((first, count))
        return [f"{tokens[j * bs]}@{j}" for j in range(first, first + count)]

    return copy_out, calls


def test_lookup_returns_the_longest_chain_of_full_blocks_and_leaves_the_last_token():
    store: PrefixStore[str] = PrefixStore(block_size=4, capacity=10)
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    copy_out, calls = payloads(prompt)
    assert store.insert(prompt, copy_out) == 2
    assert calls == [(0, 2)]
    assert store.lookup(prompt) == ["100@0", "104@1"]
    assert store.lookup(prompt[:8]) == ["100@0"]  # 8 tokens: the second block would leave none to compute
    assert store.lookup(prompt[:9]) == ["100@0", "104@1"]
    assert store.lookup([*prompt[:4], 0, 0, 0, 0, 1]) == ["100@0"]  # the second block differs
    assert store.lookup([0, *prompt[1:]]) == []  # a block is reached through its parent only
    assert store.lookup([]) == []


def test_a_block_is_shared_only_by_prompts_with_the_same_whole_prefix():
    store: PrefixStore[str] = PrefixStore(block_size=2, capacity=10)
    a, b = [1, 2, 3, 4, 9], [5, 6, 3, 4, 9]  # the same second block after different first blocks
    store.insert(a, lambda first, count: [f"a{j}" for j in range(first, first + count)])
    assert store.lookup(b) == []
    added = store.insert(b, lambda first, count: [f"b{j}" for j in range(first, first + count)])
    assert added == 2
    assert store.lookup(a) == ["a0", "a1"] and store.lookup(b) == ["b0", "b1"]


def test_insert_asks_only_for_the_blocks_after_the_stored_chain():
    store: PrefixStore[str] = PrefixStore(block_size=4, capacity=10)
    short = list(range(8))
    store.insert(short, payloads(short)[0])
    longer = list(range(20))
    copy_out, calls = payloads(longer)
    assert store.insert(longer, copy_out) == 3
    assert calls == [(2, 3)]
    copy_out, calls = payloads(longer)
    assert store.insert(longer, copy_out) == 0 and calls == []  # all stored: nothing copied
    assert store.insert([1, 2, 3], copy_out) == 0 and calls == []  # no full block


def test_the_store_never_exceeds_its_bound_and_evicts_least_recently_used_tails_first():
    store: PrefixStore[str] = PrefixStore(block_size=2, capacity=3)
    a = [1, 1, 2, 2, 3, 3, 0]
    b = [7, 7, 8, 8, 0]
    store.insert(a, payloads(a, 2)[0])
    assert len(store) == 3
    store.insert(b, payloads(b, 2)[0])  # two blocks of b evict a's two last blocks
    assert len(store) == 3
    assert store.lookup(a) == ["1@0"]
    assert store.lookup(b) == ["7@0", "8@1"]
    for n in range(10):
        other = [50 + n] * 4 + [0]
        store.insert(other, payloads(other, 2)[0])
        assert len(store) <= 3
    assert store.stats().blocks == 3 and store.stats().capacity == 3


def test_a_prompt_longer_than_the_bound_keeps_its_first_blocks():
    store: PrefixStore[str] = PrefixStore(block_size=2, capacity=2)
    prompt = list(range(11))
    copy_out, calls = payloads(prompt, 2)
    assert store.insert(prompt, copy_out) == 2
    assert calls == [(0, 2)]
    assert store.lookup(prompt) == ["0@0", "2@1"]


def test_shrinking_the_capacity_evicts_and_zero_stores_nothing():
    store: PrefixStore[str] = PrefixStore(block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert store.insert(prompt, payloads(prompt, 2)[0]) == 0  # capacity 0 until set
    store.set_capacity(5)
    store.insert(prompt, payloads(prompt, 2)[0])
    assert len(store) == 3
    store.set_capacity(1)
    assert store.lookup(prompt) == ["1@0"]  # the head was the most recently used
    store.clear()
    assert len(store) == 0 and store.lookup(prompt) == []


def test_counters_are_in_tokens():
    store: PrefixStore[str] = PrefixStore(block_size=4, capacity=10)
    prompt = list(range(10))
    store.lookup(prompt)
    store.insert(prompt, payloads(prompt)[0])
    store.lookup(prompt)
    store.lookup(prompt[:5])
    assert store.stats() == PrefixCacheStats(queries=25, hits=12, blocks=2, capacity=10)


def test_cached_tokens_counts_what_lookup_would_find_and_changes_nothing():
    store: PrefixStore[str] = PrefixStore(block_size=4, capacity=3)
    a, b = list(range(10)), list(range(50, 60))
    store.insert(a, payloads(a)[0])  # blocks a0, a1
    store.insert(b, payloads(b)[0])  # b0 evicts a0's tail: a1 (the least recently used)
    before = (store.stats(), list(store._blocks))
    assert [store.cached_tokens(p) for p in (a, a[:8], b, [7, *b[1:]], [])] == [4, 4, 8, 0, 0]
    assert (store.stats(), list(store._blocks)) == before  # no query counted, no block moved
    assert [store.cached_tokens(p) for p in (a, b)] == [4 * len(store.lookup(p)) for p in (a, b)]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        PrefixStore(block_size=0)
    with pytest.raises(ValueError, match="capacity"):
        PrefixStore(capacity=-1)
    store: PrefixStore[str] = PrefixStore(block_size=2, capacity=4)
    with pytest.raises(ValueError, match="copy_out gave 1 payloads for 2 blocks"):
        store.insert([1, 2, 3, 4, 5], lambda first, count: ["x"])
