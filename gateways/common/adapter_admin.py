"""LoRA adapter management over every core a gateway knows: what the answers of one
LoadAdapter, UnloadAdapter or ListAdapters call per core mean for the client (pure functions;
`gateways.common.core_client` makes the calls).

A gateway with several cores routes an adapter's requests to any of them (`--routing prefix`
prefers one that holds it), so an adapter loaded through the gateway must be registered on
every core, and an unloaded one on none (docs/lora.md, "Several cores"). The rules, with a
core that cannot be reached (UNAVAILABLE) left out, as it takes no request either:

- **Load** succeeds when every reachable core registered the adapter: newly, or already under
  that name from the same path (so loading again repairs a core that restarted without it).
  When any refuses (management off, a bad path, the name taken for another path), the load
  is undone: the cores that registered it in this call unregister it again, and the client
  gets the refusal, naming each core and what it said; the state left is the one before the
  call, as a single vLLM server or DJL's adapter registry leaves it after a refused load. When
  the unregistering fails on a core, the message names that core as still serving it.
  Every reachable core answering ALREADY_EXISTS is ALREADY_EXISTS, as one core says.
- **Unload** succeeds when at least one core unregistered it and no core refused; cores that
  did not hold it do not matter (the adapter is gone from the fleet either way). Every
  reachable core answering NOT_FOUND is NOT_FOUND. A refusal (management off) names the
  cores, and any that did unregister it (an unload cannot be undone: its requests ended).
- **List**: the union of the cores' adapters by name (resident on any, running and waiting
  summed), since the routes list what a request may name.

When every core gave the same refusal, the client gets it as a single core would give it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CoreReply(Generic[T]):
    """One core's answer to one management call.

    Attributes:
        address: the core (host:port, or the gateway's target when it has only one).
        value: the reply, when the call succeeded.
        error: the refusal or failure, when it did not.
    """

    address: str
    value: T | None = None
    error: GatewayError | None = None


@dataclass(frozen=True, slots=True)
class LoadVerdict:
    """What a broadcast LoadAdapter came to.

    Attributes:
        reply: the answer to give (one core's), when the load stands.
        error: the refusal to give, when it does not.
        undo: the cores to unregister the adapter from again (they registered it in this call).
    """

    reply: spb.LoadAdapterResponse | None
    error: GatewayError | None
    undo: tuple[str, ...] = ()


def unreachable(error: GatewayError) -> bool:
    """Whether a core's failure means it could not be reached (it takes no request either)."""
    return error.code is grpc.StatusCode.UNAVAILABLE


def load_verdict(
    name: str, replies: Sequence[CoreReply[spb.LoadAdapterResponse]], same_path: frozenset[str]
) -> LoadVerdict:
    """The outcome of LoadAdapter sent to every core (the module docstring's rule).

    Args:
        name: the adapter's name.
        replies: one per core, in a stable order.
        same_path: the cores that answered ALREADY_EXISTS and hold `name` from the path asked.
    """
    loaded = [r for r in replies if r.error is None]
    down = [r for r in replies if r.error is not None and unreachable(r.error)]
    had = [r for r in replies if r.error is not None and r.address in same_path]
    refused = [r for r in replies if r.error is not None and not unreachable(r.error) and r.address not in same_path]
    if refused or not loaded:
        failures = refused or had or down
        what = f"The adapter '{name}' was not loaded on every core"
        error = combined(what, failures, down if refused else [], len(replies))
        if loaded:
            error = GatewayError(
                error.code,
                f"{error.message} It was unloaded again from {_names(loaded)}, which had loaded it.",
                param=error.param,
                reason=error.reason,
            )
        return LoadVerdict(None, error, tuple(r.address for r in loaded))
    return LoadVerdict(loaded[0].value, None)


def undo_failed(error: GatewayError, replies: Sequence[CoreReply[Any]]) -> GatewayError:
    """`error` (a refused load) with the cores where unregistering it again failed named as
    still serving the adapter (NOT_FOUND there means it is gone, which is the aim)."""
    stuck = [r for r in replies if r.error is not None and r.error.code is not grpc.StatusCode.NOT_FOUND]
    if not stuck:
        return error
    details = "; ".join(f"{r.address}: {_said(r.error)}" for r in stuck if r.error is not None)
    return GatewayError(
        error.code,
        f"{error.message} Unloading it again failed on {details}; those cores still serve it.",
        param=error.param,
        reason=error.reason,
    )


def unload_error(name: str, replies: Sequence[CoreReply[Any]]) -> GatewayError | None:
    """The refusal of UnloadAdapter sent to every core, or None when the unload stands (the
    module docstring's rule)."""
    unloaded = [r for r in replies if r.error is None]
    down = [r for r in replies if r.error is not None and unreachable(r.error)]
    missing = [r for r in replies if r.error is not None and r.error.code is grpc.StatusCode.NOT_FOUND]
    refused = [r for r in replies if r.error is not None and r not in down and r not in missing]
    if refused:
        error = combined(f"The adapter '{name}' was not unloaded from every core", refused, down, len(replies))
        if unloaded:
            error = GatewayError(
                error.code,
                f"{error.message} It was unloaded from {_names(unloaded)}.",
                param=error.param,
                reason=error.reason,
            )
        return error
    if unloaded:
        return None
    return combined(f"The adapter '{name}' was not unloaded", missing or down, down if missing else [], len(replies))


def merged_listing(replies: Sequence[CoreReply[spb.ListAdaptersResponse]]) -> spb.ListAdaptersResponse:
    """The union of the cores' ListAdapters by name (sorted): an adapter is resident when it
    is on any core, its running and waiting requests are summed, its path and rank are the
    first core's; `max_loras` is the largest core's.

    Raises:
        GatewayError: a core's refusal other than being unreachable, or no core reachable.
    """
    for r in replies:
        if r.error is not None and not unreachable(r.error):
            raise r.error
    listings = [r.value for r in replies if r.value is not None]
    if not listings:
        raise combined("No core listed its adapters", replies, [], len(replies))
    if len(listings) == 1:
        return listings[0]
    merged: dict[str, spb.AdapterInfo] = {}
    for listing in listings:
        for adapter in listing.adapters:
            seen = merged.get(adapter.name)
            if seen is None:
                merged[adapter.name] = spb.AdapterInfo(
                    name=adapter.name,
                    path=adapter.path,
                    rank=adapter.rank,
                    resident=adapter.resident,
                    running=adapter.running,
                    waiting=adapter.waiting,
                )
            else:
                seen.resident = seen.resident or adapter.resident
                seen.running += adapter.running
                seen.waiting += adapter.waiting
    return spb.ListAdaptersResponse(
        adapters=[merged[n] for n in sorted(merged)], max_loras=max(x.max_loras for x in listings)
    )


def combined(what: str, failures: Sequence[CoreReply[Any]], down: Sequence[CoreReply[Any]], cores: int) -> GatewayError:
    """One error for the failures of some of `cores` cores (`down`: those not reached, named
    apart): the failure as it is when every core failed alike (or there is one core), else
    `what` and each core's answer, with the code, field and reason of the first.

    Raises:
        ValueError: no failure given.
    """
    errors = [r.error for r in failures if r.error is not None]
    if not errors:
        raise ValueError("combined() needs at least one failure")
    first = errors[0]
    alike = all(e.code is first.code and e.message == first.message for e in errors)
    if not down and len(errors) == cores and alike:
        return first
    parts = [f"{r.address} refused it ({_said(r.error)})" for r in failures if r.error is not None]
    parts += [f"{r.address} could not be reached" for r in down]
    return GatewayError(first.code, f"{what}: {'; '.join(parts)}.", param=first.param, reason=first.reason)


def _said(error: GatewayError | None) -> str:
    return "" if error is None else f"{error.code.name}: {error.message}"


def _names(replies: Sequence[CoreReply[Any]]) -> str:
    return ", ".join(r.address for r in replies)
