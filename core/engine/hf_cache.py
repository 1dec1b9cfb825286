"""Slot-addressed KV cache for the HF engine's running batch, and the attention over it.

transformers' DynamicCache grows by `torch.cat` on every decode step, copying the whole cache
each time (60% of a 32-sequence step on CPU, measured). This cache preallocates per-layer
buffers of shape [slots, kv_heads, capacity, head_dim] and writes each step's keys and values
in place. All slots share one timeline of `length` columns: a step writes column `length` for
every running sequence at once. A sequence joining the batch gets a free slot, and its prompt's
keys and values are written right-aligned to the same column (so it ends where everyone else
ends); its earlier columns are masked. Leaving frees the slot without copying anything. When the
timeline reaches the capacity, columns that no live sequence needs any more are dropped from the
left (compaction), or the capacity doubles.

Every engine step is one packed forward (`StepPlan`): the model sees one sequence of N tokens,
first one decode token per running slot, then the whole prompts of the sequences joining the
batch, each token with its own position id. The linear layers (most of a step) then run on
exactly the tokens computed, without padding, and a step that admits new sequences costs one
forward instead of a prefill forward plus a decode forward (vLLM's chunked prefill and
transformers' continuous batching pack tokens the same way). `slot_attention` (registered with
transformers' AttentionInterface as ATTENTION) attends each decode token over its own slot and
each prompt causally over its slot's columns.

A prompt whose first tokens' keys and values come from the prefix cache (core.engine.hf_prefix)
puts only the rest in the forward: the cached blocks are copied into its slot's first columns
(`write_prefix`) before the step, and its tokens attend over those columns and causally over
themselves, as one causal attention over the whole prompt's columns would. After the step, the
prompt's full blocks are copied out of the slot for the cache (`read_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

#: The attention implementation name under which `slot_attention` is registered.
ATTENTION = "trellis_slots"


@dataclass(eq=False, slots=True)
class StepPlan:
    """What one packed forward computes, and where its keys and values go.

    The forward's N tokens are `decode_rows` decode tokens (one per live slot, in slot order)
    followed by the prompts of the sequences joining the batch (of a prompt with a cached
    prefix, the tokens after it only: its prefix is in its slot already).

    Attributes:
        cache: the cache written and attended over.
        decode_rows: R, the decode tokens at the front (0 when nothing runs yet).
        extent: 1 + the highest live slot: decode attention runs over slots [0, extent).
        live_idx: [R] the live slots, or None when they are exactly 0..extent-1.
        end: the column this step writes for every decode token and every prompt's last token.
        first: the first column any running sequence attends to (the oldest one's start):
            decode attention reads columns [first, end] only, as the columns before it are
            masked for every slot.
        decode_mask: [extent, 1, 1, end + 1 - first] bool, the columns each slot attends to.
        write_slots, write_cols: [W] where each written key and value goes.
        write_src: [W] the packed token of each write, or None when W == N in token order (a
            prompt with n > 1 sequences is written to n slots).
        prefill_gather: [G, P] for each of the G joining prompts, its computed tokens' packed
            indices, left-padded to the longest P (padding repeats the first computed token).
        prefill_slots: [G] the slot holding each joining prompt's columns (its first
            sequence's), where the keys and values are read; None when no prompt of the step
            has a cached prefix: the keys and values are then this step's, gathered as the
            queries are (K == P, and the same values).
        prefill_first: the first of the K key columns of the prompts, [prefill_first, end]:
            every prompt ends at `end`, the longest one (cached prefix included) starts here.
        prefill_mask: [G, 1, P, K] bool: each computed token attends to its slot's columns up to
            its own (the cached prefix, then causally over the prompt's computed tokens); a
            padding query to its own column only (its output is dropped).
        prefill_scatter: [N - R] for each prompt token in packed order, its index in G x P.
    """

    cache: SlotKVCache
    decode_rows: int
    extent: int
    live_idx: torch.Tensor | None
    end: int
    first: int
    decode_mask: torch.Tensor | None
    write_slots: torch.Tensor
    write_cols: torch.Tensor
    write_src: torch.Tensor | None
    prefill_gather: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_first: int = 0
    prefill_mask: torch.Tensor | None = None
    prefill_scatter: torch.Tensor | None = None


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    slot_plan: StepPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one packed step (see StepPlan), in the shape of transformers' attention
    functions: query [1, heads, N, head_dim]; key and value [1, kv_heads, N, head_dim], this
    step's tokens only (already written to the cache by its update); returns ([1, N, heads,
    head_dim], None). Without a plan (a forward outside the engine's steps), plain sdpa."""
    if slot_plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    plan = slot_plan
    heads, dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    q = query[0].transpose(0, 1)  # [N, heads, dim]
    parts = []
    r = plan.decode_rows
    if r:
        layer = plan.cache.slot_layers[module.layer_idx]  # type: ignore[index]
        qd = q[:r]
        if plan.live_idx is not None:  # holes below the extent: their rows are computed and dropped
            full = q.new_zeros((plan.extent, heads, dim))
            full[plan.live_idx] = qd
            qd = full
        # One query per slot: the query heads of a kv head become that head's queries, so the
        # keys are read once per kv head (transformers' sdpa does the same for a decode step).
        qd = qd.reshape(plan.extent, kv_heads, heads // kv_heads, dim)
        cols = slice(plan.first, plan.end + 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            qd,
            layer.kbuf[: plan.extent, :, cols],
            layer.vbuf[: plan.extent, :, cols],
            attn_mask=plan.decode_mask,
            scale=scaling,
        ).reshape(plan.extent, heads, dim)
        parts.append(out if plan.live_idx is None else out[plan.live_idx])
    if plan.prefill_gather is not None:
        g, p = plan.prefill_gather.shape
        qp = query[0][:, plan.prefill_gather].transpose(0, 1)  # [G, heads, P, dim]
        if plan.prefill_slots is None:  # no cached prefix: the keys are this step's (K == P)
            kp = key[0][:, plan.prefill_gather].transpose(0, 1)
            vp = value[0][:, plan.prefill_gather].transpose(0, 1)
        else:  # from the slots (this step's written by the layer's update), prefixes included
            layer = plan.cache.slot_layers[module.layer_idx]  # type: ignore[index]
            cols = slice(plan.prefill_first, plan.end + 1)
            kp = layer.kbuf[:, :, cols].index_select(0, plan.prefill_slots)  # [G, kv_heads, K, dim]
            vp = layer.vbuf[:, :, cols].index_select(0, plan.prefill_slots)
        out = torch.nn.functional.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=plan.prefill_mask, scale=scaling, enable_gqa=kv_heads != heads
        )
        parts.append(out.transpose(1, 2).reshape(g * p, heads, dim)[plan.prefill_scatter])
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0), None


AttentionInterface.register(ATTENTION, slot_attention)


# transformers' cache classes are not annotated (their __init__ and __init_subclass__ count as
# untyped calls under mypy --strict).
class _SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's keys and values, written in place by each step's plan."""

    is_sliding = False

    def __init__(self, owner: SlotKVCache):
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        # [slots, kv_heads, capacity, head_dim] from the first write on (empty before: the
        # shapes come from the model's first step).
        self.kbuf = torch.empty(0, device=owner.device)
        self.vbuf = torch.empty(0, device=owner.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values ([1, kv_heads, N, head_dim]) where the plan says;
        returns them unchanged (slot_attention reads the rest from the buffers)."""
        plan = self.owner.plan
        assert plan is not None, "the slot cache is written by planned steps only"
        if self.kbuf.numel() == 0:
            shape = (self.owner.slots, key_states.shape[1], self.owner.capacity, key_states.shape[3])
            self.kbuf = torch.zeros(shape, dtype=key_states.dtype, device=self.owner.device)
            self.vbuf = torch.zeros_like(self.kbuf)
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [N, kv_heads, dim]
        if plan.write_src is not None:
            k, v = k[plan.write_src], v[plan.write_src]
        self.kbuf[plan.write_slots, :, plan.write_cols] = k
        self.vbuf[plan.write_slots, :, plan.write_cols] = v
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class SlotKVCache(Cache):
    """KV cache with `slots` rows sharing one timeline (see the module docstring).

    Attributes:
        length: columns of the timeline in use; the next step writes column `length`.
        capacity: columns allocated.
        mask: [slots, capacity] bool attention mask (True = a real token of that slot).
        start: per slot, the first column of its sequence.
        plan: the step being computed (set by the engine around each forward).
    """

    def __init__(self, num_layers: int, slots: int, device: torch.device, capacity: int = 256):
        self.slots = slots
        self.device = device
        self.length = 0
        self.capacity = capacity
        self.mask = torch.zeros((slots, capacity), dtype=torch.bool, device=device)
        self.start = [0] * slots
        self.plan: StepPlan | None = None
        self.slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        layers: list[Any] = list(self.slot_layers)
        super().__init__(layers=layers)

    @property
    def allocated(self) -> bool:
        """The buffers exist (from the first step's write on)."""
        return self.slot_layers[0].kbuf.numel() > 0

    def place(self, joining: list[tuple[int, int]], live: list[int]) -> int:
        """Make room for one step and give each joining sequence its columns.

        joining: (slot, prompt length) of each sequence joining the batch this step; live: the
        slots already running (their columns are preserved when the timeline moves). Returns
        the column the step writes (the cache's `length`): every running sequence's decode
        token and every joining prompt's last token; a prompt of L tokens occupies the L
        columns ending there.
        """
        self.make_room(live)
        longest = max((plen for _, plen in joining), default=0)
        if self.length + 1 < longest:
            self._shift_right(longest - 1 - self.length, live)
        end = self.length
        for slot, plen in joining:
            self.mask[slot].zero_()
            self.mask[slot, end + 1 - plen : end + 1] = True
            self.start[slot] = end + 1 - plen
        return end

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` columns over every layer's keys and values (0
        before the buffers exist)."""
        if not self.allocated:
            return 0
        k = self.slot_layers[0].kbuf
        return 2 * len(self.slot_layers) * k.shape[1] * block_size * k.shape[3] * k.element_size()

    def read_blocks(self, slot: int, first_col: int, count: int, block_size: int) -> list[torch.Tensor]:
        """Copies of `count` blocks of `block_size` columns of `slot`, from column `first_col`
        on: one tensor [layers, 2 (keys, values), kv_heads, block_size, head_dim] per block."""
        cols = slice(first_col, first_col + count * block_size)
        x = torch.stack([torch.stack((lay.kbuf[slot, :, cols], lay.vbuf[slot, :, cols])) for lay in self.slot_layers])
        return [x[:, :, :, j * block_size : (j + 1) * block_size].contiguous() for j in range(count)]

    def write_prefix(self, slots: Sequence[int], first_col: int, blocks: Sequence[torch.Tensor]) -> None:
        """Copy `blocks` (`read_blocks`' tensors, in order) into the columns of each of `slots`
        from `first_col` on (blocks exist only once the buffers do)."""
        assert self.allocated, "a prefix is copied into existing buffers only"
        x = torch.cat(list(blocks), dim=3)  # [layers, 2, kv_heads, C, dim]
        cols = slice(first_col, first_col + x.shape[3])
        rows: int | torch.Tensor = slots[0] if len(slots) == 1 else torch.tensor(list(slots), device=self.device)
        for i, layer in enumerate(self.slot_layers):
            layer.kbuf[rows, :, cols] = x[i, 0]
            layer.vbuf[rows, :, cols] = x[i, 1]

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
        for layer in self.slot_layers if self.allocated else []:
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
        if self.length + cols + 1 <= self.capacity:  # in place: no reallocation
            end, rows = self.length, max(live) + 1
            for layer in self.slot_layers if self.allocated else []:
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
    """`old`'s first `end` columns in a new [slots, heads, capacity, dim] buffer at `offset`
    (an unallocated buffer stays empty)."""
    if old.numel() == 0:
        return old
    new = torch.zeros((old.shape[0], old.shape[1], capacity, old.shape[3]), dtype=old.dtype, device=old.device)
    new[:, :, offset : offset + end] = old[:, :, :end]
    return new
