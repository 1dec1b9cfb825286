"""LoRA adapters: what the core knows of one (its PEFT config), the checks made when one is
registered, the adapters found at start, and the protocol of an engine that serves them.

Format: a directory in PEFT's layout (peft `save_pretrained`, peft 0.x): `adapter_config.json`
(`peft_type` "LORA", rank `r`, `lora_alpha`, `target_modules`, `base_model_name_or_path`,
`use_rslora`) and `adapter_model.safetensors` (`...<module>.lora_A.weight` [r, in] and
`...<module>.lora_B.weight` [out, r] per target module). An adapter adds
`scale * B @ A` to each target Linear's weight, scale = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora), peft's `LoraLayer.update_layer`.

Adapters at start, as DJL-Serving's LMI finds them (docs.djl.ai, "LoRA adapters": every
subdirectory of `<model>/adapters/` is an adapter named after it), plus `--lora-modules
name=path` (vLLM's flag). Engines that serve adapters implement `ServesAdapters`; an engine that
does not (or has max_loras 0) serves none, and a request naming one fails with NOT_FOUND.
"""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from core.errors import AdapterExists, AdapterNotFound, InvalidArgument
from logclip import clip

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The model directory's subdirectory of adapters registered at start (DJL's layout).
ADAPTERS_DIR = "adapters"
#: `--max-lora-rank` default (vLLM's `max_lora_rank` default).
MAX_LORA_RANK = 16
#: `--max-loras` default (vLLM's `max_loras` default is 1; DJL's `option.max_loras` 4).
MAX_LORAS = 4

_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")

W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One adapter as read from its adapter_config.json (weights are the engine's business).

    Attributes:
        name: what GenerateRequest.adapter selects it by.
        path: its directory.
        rank: r.
        scale: the factor of B @ A (lora_alpha / r, or / sqrt(r) with use_rslora).
        target_modules: module names or suffixes it adapts, as configured.
        base_model: base_model_name_or_path ("" when unset).
    """

    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    base_model: str = ""


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """A registered adapter right now (GetModelInfo, ListAdapters, metrics).

    Attributes:
        spec: the adapter.
        resident: its weights are in one of the engine's adapter slots.
        running: requests with it in the running batch.
        waiting: requests with it in the queue.
    """

    spec: AdapterSpec
    resident: bool = False
    running: int = 0
    waiting: int = 0


@runtime_checkable
class ServesAdapters(Protocol):
    """An engine that serves LoRA adapters (core.engine.hf, core.engine.hf_process,
    core.engine.mock). Registration is by name; `max_loras` adapters are resident at once."""

    max_loras: int

    def has_adapter(self, name: str) -> bool:
        """Whether `name` is registered (requests may name it)."""

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter, by name."""

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register `spec` (read its weights, check them against the model).

        Raises:
            InvalidArgument: the weights do not fit the model (a module's shape, a module
                that is not a Linear layer, a rank above the engine's maximum).
            AdapterNotFound: the weights file is missing.
        """

    async def unload_adapter(self, name: str) -> None:
        """Unregister `name`; requests running with it finish with it.

        Raises:
            AdapterNotFound: `name` is not registered.
        """


class AdapterSlots(Generic[W]):
    """An engine's `--max-loras` adapter slots: which registered adapter each holds, and which
    slot a request's adapter takes (pure bookkeeping; the HF engine's
    core.engine.hf_lora.LoraBank copies weights in `_place`, the mock engine holds nothing more).

    The rule (S-LoRA's and vLLM's LRU residency): an adapter already in a slot keeps it; else it
    takes a free slot, else the least recently used slot that no running request uses; when
    every slot holds another adapter with running requests, none (the request waits in the
    queue, keeping its place: core.scheduling.WaitingQueue.set_aside). Adapters are compared by
    identity, so a name registered again is another adapter.

    Args:
        max_loras: slots (> 0).

    Attributes:
        loads: adapters placed into a slot since start (each a miss: a load of its weights).
    """

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.loads = 0
        self.slots: list[W | None] = [None] * max_loras
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(max_loras))

    def slot_of(self, adapter: W) -> int | None:
        """The slot holding `adapter`, or None."""
        for s, held in enumerate(self.slots):
            if held is adapter:
                return s
        return None

    def held(self) -> list[W]:
        """The adapters in slots."""
        return [a for a in self.slots if a is not None]

    def assign(self, adapter: W, busy: set[int]) -> int | None:
        """A slot holding `adapter` (made the most recently used): the one it is in, else a
        free one, else the least recently used one not in `busy` (the slots running requests
        use), `adapter` placed in it; None when every slot is busy with other adapters."""
        slot = self.slot_of(adapter)
        if slot is None:
            free = [s for s in self._lru if self.slots[s] is None]
            idle = free or [s for s in self._lru if s not in busy]
            if not idle:
                return None
            slot = idle[0]
            self._place(slot, adapter)
            self.loads += 1
        self._lru.move_to_end(slot)
        return slot

    def forget(self, adapter: W, busy: set[int]) -> None:
        """Free the slot of an unregistered adapter unless running requests use it (it is then
        evicted like any idle slot once they end)."""
        slot = self.slot_of(adapter)
        if slot is not None and slot not in busy:
            self._empty(slot)
            self._lru.move_to_end(slot, last=False)

    def _place(self, slot: int, adapter: W) -> None:
        """Put `adapter` into `slot` (evicting what it held)."""
        self.slots[slot] = adapter

    def _empty(self, slot: int) -> None:
        """Free `slot`."""
        self.slots[slot] = None


def lora_of(engine: object) -> ServesAdapters | None:
    """The engine as a ServesAdapters when it serves adapters (max_loras > 0), else None."""
    if isinstance(engine, ServesAdapters) and engine.max_loras > 0:
        return engine
    return None


def unknown_adapter(name: str) -> AdapterNotFound:
    """The NOT_FOUND error of a request naming an adapter that is not registered."""
    return AdapterNotFound(
        f"The adapter '{clip(name)}' is not loaded on this server; ListAdapters lists those that are.",
        field="adapter",
    )


def adapter_exists(name: str) -> AdapterExists:
    """The ALREADY_EXISTS error of registering a name that is taken."""
    return AdapterExists(f"An adapter named '{clip(name)}' is loaded already; unload it first.", field="name")


def check_name(name: str, served_model: str) -> None:
    """Refuse a name requests could not select unambiguously.

    Raises:
        InvalidArgument: not 1-128 characters of letters, digits and "._:/-", or the served
            model's own name (a gateway choosing by model name could not tell them apart).
    """
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"Adapter name '{clip(name)}' must be 1 to 128 letters, digits or '._:/-'.", field="name")
    if name == served_model:
        raise InvalidArgument(f"Adapter name '{clip(name)}' is the served model's own name.", field="name")


def read_spec(name: str, path: str | Path, *, max_rank: int, model_path: str, served_model: str) -> AdapterSpec:
    """Read and check an adapter's adapter_config.json (not its weights).

    Args:
        name: the name it is registered under.
        path: its directory.
        max_rank: `--max-lora-rank`.
        model_path: the served model's directory.
        served_model: the served model's name.

    Raises:
        AdapterNotFound: no directory, adapter_config.json or adapter_model.safetensors there
            (field "path").
        InvalidArgument: the config is not JSON, not a LoRA config, uses what the engines do
            not implement (DoRA, per-module rank or alpha patterns, extra trained modules), has
            a rank above max_rank, or names another base model (field "path").
    """
    check_name(name, served_model)
    where = Path(path)
    config_file, weights_file = where / ADAPTER_CONFIG, where / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterNotFound(
            f"No PEFT adapter at '{clip(str(path))}': it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.",
            field="path",
        )
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{config_file} is not readable JSON: {e}", field="path") from None
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{config_file} is not a JSON object.", field="path")
    return spec_of(name, str(path), cfg, max_rank=max_rank, model_names=model_names(model_path, served_model))


def spec_of(name: str, path: str, cfg: Mapping[str, Any], *, max_rank: int, model_names: Iterable[str]) -> AdapterSpec:
    """The AdapterSpec of a parsed adapter_config.json (the checks of `read_spec`, pure).

    `model_names`: the names that count as the served model for base_model_name_or_path
    (compared by their last path component: a hub id "org/name" and a local ".../name" match).

    Raises:
        InvalidArgument: as `read_spec` (field "path").
    """
    where = f"The adapter at '{clip(path)}'"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidArgument(f"{where} is a {cfg.get('peft_type')} adapter; only LORA is served.", field="path")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidArgument(f"{where} has no positive integer rank 'r'.", field="path")
    if rank > max_rank:
        raise InvalidArgument(
            f"{where} has rank {rank}, above this server's --max-lora-rank {max_rank}.",
            field="path",
            reason="LORA_RANK_TOO_LARGE",
        )
    for key, what in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("modules_to_save", "fully trained extra modules (modules_to_save)"),
    ):
        if cfg.get(key):
            raise InvalidArgument(f"{where} uses {what}, which this server does not implement.", field="path")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidArgument(f"{where} has a non-numeric lora_alpha.", field="path")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    base = str(cfg.get("base_model_name_or_path") or "")
    names = {_last(n) for n in model_names if n}
    if base and _last(base) not in names:
        raise InvalidArgument(
            f"{where} was trained on '{clip(base)}', not on the served model ({', '.join(sorted(names))}).",
            field="path",
            reason="LORA_BASE_MODEL_MISMATCH",
        )
    return AdapterSpec(name, path, rank, float(scale), tuple(str(t) for t in targets), base)


def model_names(model_path: str, served_model: str) -> list[str]:
    """The names base_model_name_or_path may give the served model: its directory's name, its
    served name, and the `_name_or_path` its config.json may record."""
    names = [model_path, served_model]
    try:
        recorded = json.loads((Path(model_path) / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, str):
        names.append(recorded)
    return names


def startup_adapters(model_path: str, lora_modules: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The adapters to register at start, (name, path): every subdirectory of
    `<model_path>/adapters/` holding an adapter_config.json, by name, then `--lora-modules`
    (a name given both ways is the flag's)."""
    found: dict[str, str] = {}
    root = Path(model_path) / ADAPTERS_DIR
    if root.is_dir():
        for sub in sorted(root.iterdir()):
            if (sub / ADAPTER_CONFIG).is_file():
                found[sub.name] = str(sub)
    for name, path in lora_modules:
        found[name] = path
    return list(found.items())


def parse_lora_module(raw: str) -> tuple[str, str]:
    """`--lora-modules name=path` (vLLM's form) as (name, path).

    Raises:
        ValueError: no '=', or an empty name or path.
    """
    name, sep, path = raw.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH, got {raw!r}")
    return name.strip(), path.strip()


def _last(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]
