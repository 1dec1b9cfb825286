"""The engines' waiting queue: request priority and weighted fair shares between tenants.

Pure data structure, no I/O and no clock: the HF and mock engines keep their waiting requests
in a `WaitingQueue` and admit, at each step boundary, the request `peek()` names while it fits
their batch and token budgets (a head that does not fit stops admission, so nothing overtakes
it and a large request is never starved).

Order of service, over the requests waiting:

1. **Priority** (`--scheduling-policy priority`): the lowest `priority` value first, as vLLM's
   `--scheduling-policy priority` (vllm/v1/core/sched/request_queue.py, `PriorityRequestQueue`,
   v0.10: "lower value means higher priority", ties by arrival). With `fcfs` (the default)
   every request has the same priority and the field is ignored.
2. **Tenant fair share**: among the tenants whose first request has that priority, the tenant
   with the least virtual time. This is start-time fair queueing (Goyal, Vin and Cheng,
   "Start-time Fair Queuing", SIGCOMM 1996) with requests as packets and tokens as their
   length: admitting a request advances its tenant's virtual time by its token cost divided by
   the tenant's weight (`charge`), and the cost is corrected when the request ends
   (`settle`: a request charged for max_new_tokens that stopped early gets the rest back).
   The system virtual time is the largest virtual time at which a tenant was picked; a tenant
   that becomes backlogged starts at no less than it, so time spent idle banks no credit.
3. **Arrival**: first come, first served within a tenant and between equal tenants.

A request without a tenant belongs to the tenant "" like any other, so with one tenant and
`fcfs` the queue is plain FIFO.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, get_args

if TYPE_CHECKING:
    from core.types import EngineRequest

T = TypeVar("T")

#: `--scheduling-policy` values.
Policy = Literal["fcfs", "priority"]
POLICIES: tuple[str, ...] = get_args(Policy)


def admission_cost(req: EngineRequest) -> int:
    """The tokens a request is charged when admitted: its prompt and the most its sequences
    may generate (WaitingQueue.settle corrects it to what they did)."""
    return len(req.prompt_ids) + req.max_new_tokens * req.num_sequences


@dataclass(order=True, slots=True)
class _Entry(Generic[T]):
    """One waiting request; ordered within its tenant by (priority, arrival)."""

    priority: int
    seq: int
    item: T = field(compare=False)
    tenant: str = field(compare=False)
    cost: float = field(compare=False)


@dataclass(slots=True)
class _Tenant(Generic[T]):
    """A tenant's virtual time (tokens served / weight) and its waiting requests (a heap)."""

    vtime: float
    waiting: list[_Entry[T]] = field(default_factory=list)


class WaitingQueue(Generic[T]):
    """Waiting requests in priority, tenant fair-share and arrival order (the module docstring).

    Args:
        policy: "fcfs" (priority ignored) or "priority" (lower value first).
        weights: tenant -> weight (> 0); tenants not named weigh `default_weight`.
        default_weight: the weight of an unnamed tenant (> 0).

    Raises:
        ValueError: an unknown policy or a weight that is not a positive finite number.
    """

    def __init__(
        self, policy: str = "fcfs", weights: Mapping[str, float] | None = None, default_weight: float = 1.0
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        for name, w in {**(weights or {}), "": default_weight}.items():
            if not (w > 0 and w != float("inf")):
                raise ValueError(f"tenant weight must be a positive number, got {w!r} for {name!r}")
        self._by_priority = policy == "priority"
        self._weights = dict(weights or {})
        self._default_weight = default_weight
        # Backlogged tenants and, while they have requests running, tenants whose virtual time
        # is ahead of the system's (dropped once they fall behind it: they would restart there).
        self._tenants: dict[str, _Tenant[T]] = {}
        self._vnow = 0.0
        self._seq = itertools.count()
        self._len = 0
        self._aside: list[_Entry[T]] = []  # taken out of the order for one admission pass

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """The waiting requests, in no particular order."""
        for t in self._tenants.values():
            for e in t.waiting:
                yield e.item

    def weight(self, tenant: str) -> float:
        """The weight of `tenant` (`--tenant-weight`, else the default)."""
        return self._weights.get(tenant, self._default_weight)

    def vtime(self, tenant: str) -> float:
        """The virtual time `tenant` would be served at next (tokens / weight)."""
        t = self._tenants.get(tenant)
        return self._vnow if t is None else max(t.vtime, self._vnow)

    def push(self, item: T, *, cost: float, priority: int = 0, tenant: str = "") -> None:
        """Queue `item`, whose admission will cost `cost` tokens (prompt and the most it may
        generate, over all its sequences; `settle` corrects it when it ends)."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(self._vnow)
        elif not t.waiting:  # backlogged again: no credit from the idle time
            t.vtime = max(t.vtime, self._vnow)
        heapq.heappush(
            t.waiting, _Entry(priority if self._by_priority else 0, next(self._seq), item, tenant, float(cost))
        )
        self._len += 1

    def _next(self) -> _Tenant[T] | None:
        best: _Tenant[T] | None = None
        best_key: tuple[int, float, int] | None = None
        for t in self._tenants.values():
            if t.waiting:
                head = t.waiting[0]
                key = (head.priority, t.vtime, head.seq)
                if best_key is None or key < best_key:
                    best, best_key = t, key
        return best

    def peek(self) -> T | None:
        """The request to admit next, or None when none waits."""
        t = self._next()
        return None if t is None else t.waiting[0].item

    def pop(self) -> T:
        """Remove the request `peek` names and charge its cost to its tenant.

        Raises:
            IndexError: the queue is empty.
        """
        t = self._next()
        if t is None:
            raise IndexError("pop from an empty WaitingQueue")
        entry = heapq.heappop(t.waiting)
        self._len -= 1
        self._vnow = max(self._vnow, t.vtime)
        t.vtime += entry.cost / self.weight(entry.tenant)
        self._prune()
        return entry.item

    def set_aside(self) -> None:
        """Take the request `peek` names out of the order, uncharged, until `restore`: it cannot
        be admitted in this admission pass but those behind it may (a LoRA adapter without a
        free slot: core.engine.hf).

        Raises:
            IndexError: the queue is empty.
        """
        t = self._next()
        if t is None:
            raise IndexError("set_aside on an empty WaitingQueue")
        self._aside.append(heapq.heappop(t.waiting))
        self._len -= 1

    def restore(self) -> None:
        """Put back every request `set_aside` took, at its place (priority and arrival kept)."""
        for entry in self._aside:
            t = self._tenants.get(entry.tenant)
            if t is None:
                t = self._tenants[entry.tenant] = _Tenant(self._vnow)
            heapq.heappush(t.waiting, entry)
        self._len += len(self._aside)
        self._aside.clear()

    def settle(self, tenant: str, charged: float, served: float) -> None:
        """A request of `tenant` admitted at cost `charged` ended having served `served`
        tokens: its tenant's virtual time moves by the difference (never below the system's,
        so a refund cannot build credit either)."""
        t = self._tenants.get(tenant)
        if t is None or charged == served:
            return
        t.vtime = max(self._vnow, t.vtime - (charged - served) / self.weight(tenant))
        self._prune()

    def remove_if(self, doomed: Callable[[T], bool]) -> list[T]:
        """Remove and return the waiting requests `doomed` accepts (cancelled ones); their
        tenants are not charged."""
        removed: list[T] = []
        for t in self._tenants.values():
            keep = [e for e in t.waiting if not doomed(e.item)]
            if len(keep) != len(t.waiting):
                removed += [e.item for e in t.waiting if doomed(e.item)]
                heapq.heapify(keep)
                t.waiting = keep
        self._len -= len(removed)
        self._prune()
        return removed

    def clear(self) -> None:
        """Drop every waiting request and the tenants' virtual times."""
        self._tenants.clear()
        self._len = 0

    def _prune(self) -> None:
        """Forget idle tenants at or behind the system virtual time (they would restart there),
        so the table holds only tenants that matter, whatever the number of tenant names. With
        nothing waiting the system virtual time jumps to the largest tenant's, as a fair queue's
        does when its server goes idle: every tenant then starts level."""
        if not self._len:
            self._vnow = max([self._vnow, *(t.vtime for t in self._tenants.values())])
            self._tenants.clear()
            return
        idle = [name for name, t in self._tenants.items() if not t.waiting and t.vtime <= self._vnow]
        for name in idle:
            del self._tenants[name]
