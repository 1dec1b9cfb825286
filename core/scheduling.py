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

Two rules build on that order when a resource is full (`share`: a tenant's weight over the
weights of the tenants present, times the resource's size):

- **Preemption** (`preemption_victims`): when the running batch is full and the request to admit
  next does not fit, running requests make room for it if the queue would have served it first:
  a request of a lower priority (a higher value; vLLM v0's `Scheduler._schedule_priority_preemption`,
  vllm/core/scheduler.py, v0.6: preempt while the waiting head outranks the running tail and
  cannot be scheduled), or, at equal priority, a request of another tenant whose virtual time is
  ahead of the waiting tenant's and which holds more than its weighted share of the batch's
  sequences, while the waiting tenant, once admitted, holds no more than its own. The victim is
  the running request last in that order: the lowest priority, then the tenant furthest over its
  share (sequences per weight), then the newest. Both share conditions together mean that a
  preempted request can never preempt its way back in at the next step (no ping-pong), and with
  one tenant and `fcfs` nothing is ever preempted. The engine puts the victim back at its place
  in its tenant's order (`push` with its `seq`) and resumes it where it stopped.
- **Displacement** (`make_room`): when the queue is full, an arrival of a tenant that would hold
  no more than its weighted share of the queue, itself included, takes the place of the newest
  waiting request of the tenant most over its share (sequences per weight); otherwise it is
  refused. Requests waiting after a preemption are never displaced (their clients have output
  already).
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

#: Most running requests an engine preempts at one step boundary. Each preemption costs a
#: re-prefill of the request's prompt and generated tokens when it resumes, and the batch frees
#: about batch / mean output length sequences a step by itself, so a burst of high-priority or
#: under-share arrivals takes a few slots a step by preemption and the rest as slots free,
#: instead of evicting the whole batch at one boundary.
MAX_PREEMPTIONS_PER_STEP = 4

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
    resumed: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class Running:
    """What `WaitingQueue.preemption_victims` needs to know of one running request.

    Attributes:
        priority: the request's priority (ignored under "fcfs").
        tenant: its tenant.
        rows: the batch's sequences it holds.
        seq: its arrival number (`WaitingQueue.push`'s return value).
        preemptible: whether the engine can preempt it now (e.g. not in its prefill).
    """

    priority: int
    tenant: str
    rows: int
    seq: int
    preemptible: bool = True


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

    def push(self, item: T, *, cost: float, priority: int = 0, tenant: str = "", seq: int | None = None) -> int:
        """Queue `item`, whose admission will cost `cost` tokens (prompt and the most it may
        generate, over all its sequences; `settle` corrects it when it ends). Returns its
        arrival number, which orders it within its tenant and priority.

        `seq` requeues a preempted request at its place: the arrival number `push` returned
        for it first. Such a request is never displaced (`make_room`)."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(self._vnow)
        elif not t.waiting:  # backlogged again: no credit from the idle time
            t.vtime = max(t.vtime, self._vnow)
        resumed = seq is not None
        if seq is None:
            seq = next(self._seq)
        heapq.heappush(t.waiting, _Entry(priority if self._by_priority else 0, seq, item, tenant, float(cost), resumed))
        self._len += 1
        return seq

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

    def _raw_vtime(self, tenant: str) -> float:
        """The virtual time `_next` would order `tenant`'s next request by."""
        t = self._tenants.get(tenant)
        return self._vnow if t is None else t.vtime

    def _share(self, size: float, tenants: set[str]) -> Callable[[str], float]:
        total = sum(self.weight(name) for name in tenants)
        return lambda name: size * self.weight(name) / total

    def make_room(self, tenant: str) -> T | None:
        """The queue is full and a request of `tenant` arrives: remove and return the waiting
        request it displaces (the module docstring), uncharged, or None when the arrival is to
        be refused.

        The queue's size is taken as its current length; shares are of that, by weight, among
        the tenants waiting and `tenant`."""
        held = {name: len(t.waiting) for name, t in self._tenants.items() if t.waiting}
        share = self._share(self._len, {*held, tenant})
        if held.get(tenant, 0) + 1 > share(tenant):
            return None
        victim: _Tenant[T] | None = None
        over = 0.0
        for name, t in self._tenants.items():
            if name == tenant or not any(not e.resumed for e in t.waiting):
                continue
            ratio = held[name] / self.weight(name)
            if held[name] > share(name) and ratio > over:
                victim, over = t, ratio
        if victim is None:
            return None
        newest = max((e for e in victim.waiting if not e.resumed), key=lambda e: (e.priority, e.seq))
        victim.waiting.remove(newest)
        heapq.heapify(victim.waiting)
        self._len -= 1
        self._prune()
        return newest.item

    def preemption_victims(
        self, running: list[Running], *, head_rows: int, free_rows: int, batch_rows: int, limit: int
    ) -> list[int]:
        """The running requests to preempt so that the request `peek` names, which needs
        `head_rows` sequences where `free_rows` of the batch's `batch_rows` are free, can be
        admitted (the module docstring's rule), as indices into `running`, at most `limit` of
        them. Empty when it fits already, when nothing waits, or when the rule does not free
        enough room within `limit` (then nothing is preempted)."""
        head_tenant = self._next()
        if head_tenant is None or head_rows <= free_rows or limit <= 0:
            return []
        head = head_tenant.waiting[0]
        held: dict[str, int] = {}
        for r in running:
            held[r.tenant] = held.get(r.tenant, 0) + r.rows
        share = self._share(batch_rows, {*held, *(n for n, t in self._tenants.items() if t.waiting)})
        head_fits_share = held.get(head.tenant, 0) + head_rows <= share(head.tenant)
        chosen: list[int] = []
        free = free_rows
        while free < head_rows:
            if len(chosen) == limit:
                return []
            best, best_key = -1, (0, 0.0, 0)
            for i, r in enumerate(running):
                if not r.preemptible or i in chosen:
                    continue
                priority = r.priority if self._by_priority else 0
                if priority < head.priority:
                    continue
                if priority == head.priority and not (
                    r.tenant != head.tenant
                    and head_fits_share
                    and self._raw_vtime(r.tenant) > head_tenant.vtime
                    and held[r.tenant] > share(r.tenant)
                ):
                    continue
                key = (priority, held[r.tenant] / self.weight(r.tenant), r.seq)
                if best < 0 or key > best_key:
                    best, best_key = i, key
            if best < 0:
                return []
            chosen.append(best)
            free += running[best].rows
            held[running[best].tenant] -= running[best].rows
        return chosen

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
