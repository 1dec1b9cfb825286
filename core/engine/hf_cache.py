"""Slot-addressed KV cache for the HF engine's running batch.

transformers' DynamicCache grows by `torch.cat` on every decode step, copying the whole cache
each time (60% of a 32-sequence step on CPU, measured). This cache preallocates per-layer
buffers of shape [slots, kv_heads, capacity, head_dim] and writes each step's keys and values
in place. All slots share one timeline of `length` columns: a decode step writes column
`length` for every slot at once. A sequence joining the batch gets a free slot, and its
prefilled keys and values are copied right-aligned to the current timeline (so it ends where
everyone else ends); its earlier columns are masked. Leaving frees the slot without copying
anything. When the timeline reaches the capacity, columns that no live sequence needs any more
are dropped from the left (compaction), or the capacity doubles.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


# transformers' cache classes are not annotated (their __init__ and __init_subclass__ count as
# untyped calls under mypy --strict).
class _SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's keys and values, written in place at the shared timeline's end."""

    is_sliding = False

    def __init__(self, owner: SlotKVCache):
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        # [slots, kv_heads, capacity, head_dim] once the cache is allocated (empty before).
        self.kbuf = torch.empty(0, device=owner.device)
        self.vbuf = torch.empty(0, device=owner.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the buffers come from SlotKVCache._allocate

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, end = key_states.shape[0], self.owner.length
        n = key_states.shape[-2]
        self.kbuf[:rows, :, end : end + n] = key_states
        self.vbuf[:rows, :, end : end + n] = value_states
        self.keys = self.kbuf[:rows, :, : end + n]
        self.values = self.vbuf[:rows, :, : end + n]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class SlotKVCache(Cache):
    """KV cache with `slots` rows sharing one timeline (see the module docstring).

    Attributes:
        length: columns of the timeline in use; the next decode step writes column `length`.
        capacity: columns allocated.
        mask: [slots, capacity] bool attention mask (True = a real token of that slot).
        start: per slot, the first column of its sequence.
    """

    def __init__(self, num_layers: int, slots: int, device: torch.device, capacity: int = 256):
        self.slots = slots
        self.device = device
        self.length = 0
        self.capacity = capacity
        self.mask = torch.zeros((slots, capacity), dtype=torch.bool, device=device)
        self.start = [0] * slots
        self.allocated = False
        self.slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        layers: list[Any] = list(self.slot_layers)
        super().__init__(layers=layers)

    def _allocate(self, shapes: list[tuple[int, int, torch.dtype]]) -> None:
        self.allocated = True
        for layer, (heads, dim, dtype) in zip(self.slot_layers, shapes, strict=True):
            layer.kbuf = torch.zeros((self.slots, heads, self.capacity, dim), dtype=dtype, device=self.device)
            layer.vbuf = torch.zeros_like(layer.kbuf)

    def insert(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor], live: list[int]) -> None:
        """Place a prefilled sequence in `slot`, right-aligned to the timeline's end.

        keys / values: per layer, [kv_heads, prompt_len, head_dim]. live: slots of the other
        sequences still running (their columns are preserved when the timeline shifts). Insert
        a group of sequences longest first: the first insert then makes room for all of them.
        """
        plen = keys[0].shape[1]
        if not self.allocated:
            self._allocate([(k.shape[0], k.shape[2], k.dtype) for k in keys])
        if self.length < plen:
            self._shift_right(plen - self.length, live)
        if self.length + 1 > self.capacity:
            self.make_room(live)
        begin = self.length - plen
        for layer, k, v in zip(self.slot_layers, keys, values, strict=True):
            layer.kbuf[slot, :, begin : self.length] = k
            layer.vbuf[slot, :, begin : self.length] = v
        self.mask[slot].zero_()
        self.mask[slot, begin : self.length] = True
        self.start[slot] = begin

    def release(self, slot: int) -> None:
        """Free a slot (its columns are masked; nothing is copied)."""
        self.mask[slot].zero_()

    def make_room(self, live: list[int]) -> None:
        """Ensure one more column fits: drop columns no live slot needs, or double the capacity.

        Also compacts early when at least half the timeline is dead, keeping attention short.
        """
        first = min((self.start[s] for s in live), default=self.length)
        if self.length + 1 <= self.capacity and not (first >= 64 and first * 2 >= self.length):
            return
        if first > 0:
            self._shift_left(first, live)
        if self.length + 1 > self.capacity:
            self._grow(max(self.capacity * 2, self.length + 1))

    def _shift_left(self, cols: int, live: list[int]) -> None:
        keep = self.length - cols
        for layer in self.slot_layers:
            layer.kbuf[:, :, :keep] = layer.kbuf[:, :, cols : self.length].clone()
            layer.vbuf[:, :, :keep] = layer.vbuf[:, :, cols : self.length].clone()
        self.mask[:, :keep] = self.mask[:, cols : self.length].clone()
        self.mask[:, keep:] = False
        self.length = keep
        for s in live:
            self.start[s] -= cols

    def _shift_right(self, cols: int, live: list[int]) -> None:
        if not live:
            self.mask.zero_()
            if self.length + cols + 1 > self.capacity:  # grow before the timeline passes the old buffers' end
                self._grow(max(self.capacity * 2, self.length + cols + 1))
            self.length += cols
            return
        if self.length + cols + 1 <= self.capacity and self.allocated:  # in place: no reallocation
            end, rows = self.length, max(live) + 1
            for layer in self.slot_layers:
                for buf in (layer.kbuf, layer.vbuf):
                    buf[:rows, :, cols : cols + end] = buf[:rows, :, :end].clone()
            self.mask[:, cols : cols + end] = self.mask[:, :end].clone()
            self.mask[:, :cols] = False
            self.length = end + cols
        else:
            self._rebuild(max(self.capacity, self.length + cols + 1), offset=cols)
        for s in live:
            self.start[s] += cols

    def _grow(self, capacity: int) -> None:
        self._rebuild(capacity, offset=0)

    def _rebuild(self, capacity: int, offset: int) -> None:
        """Reallocate to `capacity` columns, moving the used columns right by `offset`."""
        end = self.length
        for layer in self.slot_layers:
            layer.kbuf, layer.vbuf = (_moved(old, capacity, offset, end) for old in (layer.kbuf, layer.vbuf))
        mask = torch.zeros((self.slots, capacity), dtype=torch.bool, device=self.device)
        mask[:, offset : offset + end] = self.mask[:, :end]
        self.mask = mask
        self.capacity = capacity
        self.length = end + offset


def _moved(old: torch.Tensor, capacity: int, offset: int, end: int) -> torch.Tensor:
    """`old`'s first `end` columns in a new [slots, heads, capacity, dim] buffer at `offset`."""
    new = torch.zeros((old.shape[0], old.shape[1], capacity, old.shape[3]), dtype=old.dtype, device=old.device)
    new[:, :, offset : offset + end] = old[:, :, :end]
    return new
