"""Automatic prefix caching for the HF engine: a bounded store of prompt KV blocks.

Multi-turn chats and agents send the same long prefix again and again (a system prompt, the
conversation so far, tool descriptions). The store keeps the keys and values of full blocks of
`block_size` prompt tokens after their prefill, so that a later prompt starting with the same
tokens copies them into its KV slot and computes only the rest (vLLM's automatic prefix
caching, vllm/v1/core/kv_cache_utils.py and block_pool.py, release 0.10/0.11: the same block
chaining, full blocks only, LRU eviction, tails evicted before heads).

A block is identified by its parent block and its own tokens: the dict key is
`(parent_id, tuple(tokens))`, the root's parent id being 0, so equal keys mean equal token
prefixes exactly (the dict compares keys, a hash collision cannot alias two prefixes) and a
block's keys and values, which depend on every token before it, are shared only by prompts with
that whole prefix. A chain may start from another root than 0 (a negative number the caller
chooses): keys and values computed with a LoRA adapter differ from the base model's, so each
adapter's blocks hang off a root of their own (vLLM puts the LoRA id in its block hash, the
same separation). Each stored block gets a fresh id; when a block is evicted its descendants
become unreachable and age out of the LRU order in turn.

The store is pure Python and holds one opaque payload per block (the engine's tensor of every
layer's keys and values for those tokens: core.engine.hf_cache.SlotKVCache.read_blocks). It is
used from the engine's worker thread only; `stats` may be read from any thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from core.types import PrefixCacheStats

T = TypeVar("T")

#: Tokens per block (`--prefix-cache-block-size`; vLLM's default block size).
BLOCK_SIZE = 16


#: A block's key: its parent's id (0: none) and its tokens.
_Key = tuple[int, tuple[int, ...]]


@dataclass(eq=False, slots=True)
class _Block(Generic[T]):
    id: int
    key: _Key
    payload: T


class PrefixStore(Generic[T]):
    """LRU store of full prompt blocks chained by prefix (see the module docstring).

    Args:
        block_size: tokens per block (> 0).
        capacity: blocks held at most (0: nothing is stored; `set_capacity` may change it).

    Raises:
        ValueError: block_size < 1 or capacity < 0.
    """

    def __init__(self, block_size: int = BLOCK_SIZE, capacity: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._capacity = 0
        # Least recently used first; a lookup or insert moves a chain to the end tail first, so
        # that its head is the most recent and a chain loses its tail blocks before its head.
        self._blocks: collections.OrderedDict[_Key, _Block[T]] = collections.OrderedDict()
        self._next_id = 1
        self.queries = 0
        self.hits = 0
        self.set_capacity(capacity)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        """Blocks held at most."""
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        """Bound the store to `capacity` blocks, evicting the least recently used beyond it.

        Raises:
            ValueError: capacity < 0.
        """
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        while len(self._blocks) > capacity:
            self._blocks.popitem(last=False)

    def stats(self) -> PrefixCacheStats:
        """The counters and the blocks held."""
        return PrefixCacheStats(self.queries, self.hits, len(self._blocks), self._capacity)

    def lookup(self, tokens: Sequence[int], root: int = 0) -> list[T]:
        """The payloads of the longest cached chain of full blocks that `tokens` starts with,
        in order, capped so that at least the last token is left to compute (its logits give
        the first generated token): at most (len(tokens) - 1) // block_size blocks. Counts
        len(tokens) queries and block_size hits per block returned; the chain becomes the most
        recently used. `root`: the chain's root (0, or a negative number of the caller's)."""
        self.queries += len(tokens)
        found = self._chain(tokens, (len(tokens) - 1) // self.block_size if tokens else 0, root)
        self._touch(found)
        self.hits += len(found) * self.block_size
        return [block.payload for block in found]

    def cached_tokens(self, tokens: Sequence[int], root: int = 0) -> int:
        """The tokens `lookup(tokens, root)` would find now (a multiple of block_size), without
        counting a query or moving the chain: what a request's prefill may skip, for an
        admission budget."""
        limit = (len(tokens) - 1) // self.block_size if tokens else 0
        return len(self._chain(tokens, limit, root)) * self.block_size

    def insert(self, tokens: Sequence[int], copy_out: Callable[[int, int], Sequence[T]], root: int = 0) -> int:
        """Store the full blocks of `tokens` that are not stored yet (at most `capacity` blocks
        from the start); returns how many were added.

        The blocks missing are always the chain's tail from its first miss on (a block's key
        names its parent's id), so `copy_out(first, count)` is asked once, for the payloads of
        blocks first .. first + count - 1, and must return `count` of them. Blocks of other
        prompts are evicted least recently used first to make room; this prompt's chain is the
        most recently used afterwards, its head last. `root`: as for `lookup`.
        """
        bs = self.block_size
        full = min(len(tokens) // bs, self._capacity)
        chain = self._chain(tokens, full, root)
        first = len(chain)
        if first < full:
            self._touch(chain)  # the chain's stored head outlives the evictions below
            payloads = copy_out(first, full - first)
            if len(payloads) != full - first:
                raise ValueError(f"copy_out gave {len(payloads)} payloads for {full - first} blocks")
            parent = chain[-1].id if chain else root
            for j, payload in enumerate(payloads, start=first):
                while len(self._blocks) >= self._capacity:
                    self._blocks.popitem(last=False)
                block = _Block(self._next_id, (parent, tuple(tokens[j * bs : (j + 1) * bs])), payload)
                self._next_id += 1
                self._blocks[block.key] = block
                chain.append(block)
                parent = block.id
        self._touch(chain)
        return full - first

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._blocks.clear()

    def _chain(self, tokens: Sequence[int], limit: int, root: int = 0) -> list[_Block[T]]:
        """The stored blocks `tokens` starts with from `root`, up to `limit` blocks."""
        bs, parent = self.block_size, root
        found: list[_Block[T]] = []
        for j in range(limit):
            block = self._blocks.get((parent, tuple(tokens[j * bs : (j + 1) * bs])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        return found

    def _touch(self, chain: list[_Block[T]]) -> None:
        """Make `chain` the most recently used, its head last (evicted after its tail)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)
