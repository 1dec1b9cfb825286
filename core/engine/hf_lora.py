"""LoRA adapters in the HF engine's packed steps: every adapted Linear layer adds, to the tokens
of each adapter in the step, that adapter's `x @ A.T @ B.T * scale`, so that requests with
different adapters, and none, share one forward.

Layout (S-LoRA's and punica's, without their custom kernels): `--max-loras` slots; each
adapted Linear holds A as [max_rank, slots, in] and (scale * B)^T as [max_rank, slots, out],
zero beyond an adapter's rank, so that the first r ranks of every slot are one contiguous
[r * slots, in] (and [r * slots, out]) matrix. A step's tokens come with their slots
(`LoraBank.set_step`, built from the per-token slots the engine packs in its forward's order),
and a step mixes adapters in one of two ways:

  * stacked (while ranks x slots <= STACKED_COLUMNS): one GEMM of the step's tokens with every
    slot's A, a mask that keeps each token's own slot's columns (zero for the base model's
    tokens), and one GEMM with every slot's B added in place: four operations per layer
    whatever the number of adapters, at the cost of computing the other slots' columns;
  * grouped: per slot present, one GEMM pair over a contiguous copy of that slot's tokens
    added in place (`index_add_`): at most max_loras groups, where a per-token gather of A
    and B (a batched matmul of [N, in, r]) would copy r x in weights per token.

A step whose tokens all share one adapter takes that adapter's GEMM pair alone. peft's
mixed-adapter batches (`adapter_names=`, peft `LoraLayer._mixed_batch_forward`) group per
sub-batch of whole sequences, which a packed step does not have; scripts/bench/lora_mixed.py
measures them against these layers.

Residency: a registered adapter's weights stay on the CPU side (`AdapterWeights`) until a
request needs it; `LoraBank.assign` (core.lora.AdapterSlots, which the mock engine shares)
copies them into a free slot, or the least recently used slot that no running sequence uses,
and says when none is free (the request then waits in the queue). All of this, the wrapping
of the model's Linear layers included, runs on the engine's worker thread between steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import AdapterNotFound, InvalidArgument
from core.lora import ADAPTER_WEIGHTS, AdapterSlots, AdapterSpec
from logclip import clip

#: Prefixes peft puts before the model's own module paths in adapter_model.safetensors.
_PREFIXES = ("base_model.model.", "base_model.")
_ROOTS = itertools.count(1)
#: The most columns (ranks x slots) a stacked step computes per token: below it the other
#: slots' columns cost less than the grouped way's per-slot copies and kernel launches (on a
#: 4096-wide layer, 256 columns add about 6 % to the base GEMM).
STACKED_COLUMNS = 256


@dataclass(eq=False, slots=True)
class AdapterWeights:
    """A registered adapter's weights, on the engine's device, keyed by module path.

    Attributes:
        spec: the adapter.
        modules: module path -> (A [r, in], scale * B [out, r]).
        root: a number no other registration shares (a negative prefix-cache root: blocks
            computed with this adapter are found only by its requests).
    """

    spec: AdapterSpec
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    root: int


def load_weights(spec: AdapterSpec, model: torch.nn.Module, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """Read `spec`'s adapter_model.safetensors and check it against `model`.

    Raises:
        AdapterNotFound: the weights file is gone.
        InvalidArgument: a tensor that is not a lora_A/lora_B weight of a module, a module the
            model lacks or that is not a Linear layer, shapes that do not fit it, A and B of
            different ranks, or a rank above max_rank (field "path").
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = f"The adapter at '{clip(spec.path)}'"
    try:
        tensors = load_file(f"{spec.path}/{ADAPTER_WEIGHTS}", device="cpu")
    except FileNotFoundError:
        raise AdapterNotFound(f"{where} has no {ADAPTER_WEIGHTS}.", field="path") from None
    except (SafetensorError, OSError) as e:
        raise InvalidArgument(f"{where}: {ADAPTER_WEIGHTS} is not readable: {e}", field="path") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        path, _, rest = key.partition(".lora_")
        if rest not in ("A.weight", "B.weight"):
            raise InvalidArgument(f"{where} holds '{clip(key)}', not a lora_A or lora_B weight.", field="path")
        for prefix in _PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix) :]
                break
        halves.setdefault(path, {})[rest[0]] = tensor
    if not halves:
        raise InvalidArgument(f"{where} has no weights.", field="path")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    device = next(model.parameters()).device
    for path, pair in halves.items():
        linear = _linear(model, path, where)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise InvalidArgument(f"{where} has only one of lora_A and lora_B for '{clip(path)}'.", field="path")
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != linear.in_features:
            raise InvalidArgument(
                f"{where} does not fit '{clip(path)}': lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"for a Linear of {linear.in_features} -> {linear.out_features}.",
                field="path",
                reason="LORA_BASE_MODEL_MISMATCH",
            )
        if b.shape[0] != linear.out_features:
            raise InvalidArgument(
                f"{where} does not fit '{clip(path)}': lora_B has {b.shape[0]} outputs, the model's Linear "
                f"{linear.out_features}.",
                field="path",
                reason="LORA_BASE_MODEL_MISMATCH",
            )
        if r > max_rank:
            raise InvalidArgument(
                f"{where} has rank {r} at '{clip(path)}', above --max-lora-rank {max_rank}.",
                field="path",
                reason="LORA_RANK_TOO_LARGE",
            )
        modules[path] = (a.to(device, dtype), (b.float() * spec.scale).to(device, dtype))
    return AdapterWeights(spec, modules, -next(_ROOTS))


def _linear(model: torch.nn.Module, path: str, where: str) -> torch.nn.Linear:
    """The model's Linear layer at `path` (unwrapped when it is adapted already)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise InvalidArgument(
            f"{where} adapts '{clip(path)}', which the served model does not have.",
            field="path",
            reason="LORA_BASE_MODEL_MISMATCH",
        ) from None
    if isinstance(module, LoraLinear):
        return module.base
    if not isinstance(module, torch.nn.Linear):
        raise InvalidArgument(
            f"{where} adapts '{clip(path)}', a {type(module).__name__}; only Linear layers are served.",
            field="path",
        )
    return module


class LoraLinear(torch.nn.Module):
    """A Linear layer plus the adapters of the tokens of the current step (see the module
    docstring). Input [..., in] -> [..., out]; without a step's groups, the base layer alone."""

    def __init__(self, base: torch.nn.Linear, bank: LoraBank):
        super().__init__()
        self.base = base
        self.bank = bank
        slots, rank = bank.max_loras, bank.max_rank
        w = base.weight
        self.a = torch.zeros((rank, slots, base.in_features), dtype=w.dtype, device=w.device)
        self.b = torch.zeros((rank, slots, base.out_features), dtype=w.dtype, device=w.device)
        self.ranks = [0] * slots
        self.top = 0  # the largest rank in a slot: the stacked matrices' first `top` ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        groups = self.bank.groups
        if not groups:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        mask = self.bank.mask
        if mask is not None:
            if self.top:
                columns = self.top * self.bank.max_loras
                a, b = self.a[: self.top].view(columns, -1), self.b[: self.top].view(columns, -1)
                flat_y.addmm_((flat_x @ a.T).mul_(mask[:, :columns]), b)
            return y
        for slot, idx in groups:
            r = self.ranks[slot]
            if not r:
                continue
            a, b = self.a[:r, slot], self.b[:r, slot]
            if idx is None:  # every token of the step
                flat_y.addmm_(flat_x @ a.T, b)
            else:
                flat_y.index_add_(0, idx, (flat_x.index_select(0, idx) @ a.T) @ b)
        return y

    def put(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write an adapter's (A, scale * B) into `slot` (None: this layer is not adapted)."""
        self.a[:, slot].zero_()
        self.b[:, slot].zero_()
        r = 0
        if weights is not None:
            a, b = weights
            r = a.shape[0]
            self.a[:r, slot] = a
            self.b[:r, slot] = b.T
        self.ranks[slot] = r
        self.top = max(self.ranks)


class LoraBank(AdapterSlots[AdapterWeights]):
    """The engine's adapter slots (core.lora.AdapterSlots: residency and eviction) and the
    model's adapted layers, which hold each slot's weights (worker thread only).

    Args:
        model: the served transformers model (its Linear layers are wrapped as adapters need).
        max_loras: slots (`--max-loras`, > 0).
        max_rank: `--max-lora-rank`.
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        super().__init__(max_loras)
        self.model = model
        self.max_rank = max_rank
        self.layers: dict[str, LoraLinear] = {}
        # This step's token groups: (slot, token indices or None for all tokens).
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        # A stacked step's [tokens, max_rank * slots] mask (column k belongs to slot
        # k % slots); None for a grouped step (module docstring).
        self.mask: torch.Tensor | None = None
        self._stacked = max_rank * max_loras <= STACKED_COLUMNS
        self._dtype = next(model.parameters()).dtype

    def resident(self) -> frozenset[str]:
        """Names of the adapters in slots."""
        return frozenset(w.spec.name for w in self.held())

    def set_step(self, token_slots: list[int], device: torch.device) -> None:
        """Prepare the step's packed tokens, each with its slot (-1: the base model): one
        adapter for all, else a stacked step's mask or the grouped step's groups."""
        n = len(token_slots)
        present = sorted(set(token_slots) - {-1})
        self.mask = None
        if not present or (len(present) == 1 and token_slots.count(present[0]) == n):
            self.groups = [(s, None) for s in present]
            return
        if self._stacked:
            owner = torch.tensor(token_slots, device=device)
            column_slot = torch.arange(self.max_rank * self.max_loras, device=device) % self.max_loras
            self.mask = (owner[:, None] == column_slot[None, :]).to(self._dtype)
            self.groups = [(s, None) for s in present]
            return
        self.groups = [
            (s, torch.tensor([i for i, t in enumerate(token_slots) if t == s], device=device)) for s in present
        ]

    def clear_step(self) -> None:
        """After the forward: the layers run as the base model until the next `set_step`."""
        self.groups = []
        self.mask = None

    def _place(self, slot: int, adapter: AdapterWeights) -> None:
        for path in adapter.modules:
            if path not in self.layers:
                self._wrap(path)
        for path, layer in self.layers.items():
            layer.put(slot, adapter.modules.get(path))
        super()._place(slot, adapter)

    def _empty(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.put(slot, None)
        super()._empty(slot)

    def _wrap(self, path: str) -> None:
        parent_path, _, child = path.rpartition(".")
        parent: Any = self.model.get_submodule(parent_path) if parent_path else self.model
        base = getattr(parent, child)
        assert isinstance(base, torch.nn.Linear), "load_weights admits Linear layers only"
        layer = LoraLinear(base, self)
        setattr(parent, child, layer)
        self.layers[path] = layer
