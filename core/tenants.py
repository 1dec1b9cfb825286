"""Per-tenant limits and counts: the core's side of tenant fair shares (docs/fleet.md).

A tenant is who a request is served for: the name of the caller's API key (`--api-key
name:key`), else the request's `tenant` field (a gateway's `x-gateway-inference-fairness-id`
header), else the default tenant "". The engines' waiting queue shares the engine between
tenants (core.scheduling); this module refuses a tenant's new requests over its limits, before
they reach the engine, and keeps the per-tenant counts the metrics export:

- `--tenant-max-running N`: at most N requests of one tenant queued or running at once.
- `--tenant-tokens-per-minute N`: a token bucket of N tokens per tenant, refilled at N per
  minute, drawn by every ended request's prompt and generated tokens. A tenant whose bucket is
  empty (or in debt: requests in flight finish whatever they cost) is refused until it refills.

Both refusals are RESOURCE_EXHAUSTED (core.errors.Overloaded, reason TENANT_LIMIT) with a
google.rpc.RetryInfo delay, which the gateways answer as 429 with Retry-After. The counts are
kept per tenant name for the limits, and per metric label for Prometheus, where the first
MAX_TENANT_LABELS tenants seen keep their name and later ones count as "other", so a client
that invents tenant names cannot grow the metrics without bound.

Event loop thread only (the pipeline's Jobs call it), so plain dicts, no lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import Overloaded

#: Tenants whose counts are exported under their own name; the rest are OTHER_LABEL.
MAX_TENANT_LABELS = 64
OTHER_LABEL = "other"
#: The metric label of the default tenant (requests without a tenant).
DEFAULT_LABEL = "default"
#: Retry delay of a refusal over --tenant-max-running, in seconds (when a slot frees is unknown).
RUNNING_RETRY_S = 1.0


@dataclass(slots=True)
class TenantCounts:
    """One metric label's counts: gauges `waiting` and `running`; counters the rest.
    `preemptions` counts the times a running request of the tenant was preempted (it counts as
    running meanwhile: core.scheduling)."""

    waiting: int = 0
    running: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    refusals: int = 0
    preemptions: int = 0


class Tenants:
    """Per-tenant limits and counts (see the module docstring).

    Args:
        max_running: requests one tenant may have queued or running (0: no limit).
        tokens_per_minute: one tenant's token budget per minute (0: no limit).
        max_labels: tenants exported under their own metric label.

    Raises:
        ValueError: a negative limit.
    """

    def __init__(self, max_running: int = 0, tokens_per_minute: int = 0, max_labels: int = MAX_TENANT_LABELS):
        if max_running < 0 or tokens_per_minute < 0:
            raise ValueError("tenant limits must be >= 0")
        self.max_running = max_running
        self.tokens_per_minute = tokens_per_minute
        self._rate = tokens_per_minute / 60.0  # tokens per second
        self._max_labels = max_labels
        self.counts: dict[str, TenantCounts] = {}  # by metric label
        self._live: dict[str, int] = {}  # tenant -> requests queued or running
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens left, at monotonic time)

    def label(self, tenant: str) -> str:
        """The metric label of `tenant`: its name, DEFAULT_LABEL for "", OTHER_LABEL past the cap."""
        name = tenant or DEFAULT_LABEL
        if name in self.counts or len(self.counts) < self._max_labels:
            return name
        return OTHER_LABEL

    def _counts(self, tenant: str) -> TenantCounts:
        label = self.label(tenant)
        c = self.counts.get(label)
        if c is None:
            c = self.counts[label] = TenantCounts()
        return c

    def admit(self, tenant: str, now: float) -> None:
        """Take a new request of `tenant` (it waits until `scheduled`), or refuse it.

        Raises:
            Overloaded: reason TENANT_LIMIT, with `retry_delay`: the tenant is at its
                --tenant-max-running, or its token bucket is empty.
        """
        live = self._live.get(tenant, 0)
        who = f"Tenant '{tenant}'" if tenant else "The default tenant"
        if self.max_running and live >= self.max_running:
            self.refused(tenant)
            raise Overloaded(
                f"{who} has {live} requests queued or running, its limit (--tenant-max-running); retry later.",
                reason="TENANT_LIMIT",
                retry_delay=RUNNING_RETRY_S,
            )
        if self._rate:
            level = self._level(tenant, now)
            if level <= 0:
                self.refused(tenant)
                delay = max(1.0, math.ceil((1.0 - level) / self._rate))
                raise Overloaded(
                    f"{who} has used its {self.tokens_per_minute} tokens per minute (--tenant-tokens-per-minute); "
                    f"retry in {delay:.0f} s.",
                    reason="TENANT_LIMIT",
                    retry_delay=delay,
                )
        self._live[tenant] = live + 1
        self._counts(tenant).waiting += 1

    def refused(self, tenant: str) -> None:
        """Count a refusal of a request of `tenant` (its limits, or the engine's full queue)."""
        self._counts(tenant).refusals += 1

    def preempted(self, tenant: str) -> None:
        """Count a preemption of a running request of `tenant` (core.scheduling)."""
        self._counts(tenant).preemptions += 1

    def withdraw(self, tenant: str) -> None:
        """An admitted request of `tenant` never reached the engine (the engine refused it)."""
        self._counts(tenant).waiting -= 1
        self._leave(tenant)

    def scheduled(self, tenant: str) -> None:
        """A waiting request of `tenant` entered the running batch."""
        c = self._counts(tenant)
        c.waiting -= 1
        c.running += 1

    def ended(self, tenant: str, *, scheduled: bool, prompt_tokens: int, generation_tokens: int, now: float) -> None:
        """A request of `tenant` ended (finished, failed or cancelled), having used these tokens
        (prompt_tokens is 0 when it never ran)."""
        c = self._counts(tenant)
        if scheduled:
            c.running -= 1
        else:
            c.waiting -= 1
        c.prompt_tokens += prompt_tokens
        c.generation_tokens += generation_tokens
        self._leave(tenant)
        if self._rate:
            level = self._level(tenant, now) - prompt_tokens - generation_tokens
            if level < self.tokens_per_minute:
                self._buckets[tenant] = (level, now)
            else:  # full again, or never drawn: nothing to remember
                self._buckets.pop(tenant, None)

    def _leave(self, tenant: str) -> None:
        live = self._live.get(tenant, 0) - 1
        if live > 0:
            self._live[tenant] = live
        else:
            self._live.pop(tenant, None)

    def _level(self, tenant: str, now: float) -> float:
        """The tokens left in `tenant`'s bucket at `now` (negative: in debt); full buckets of
        tenants with nothing live are forgotten."""
        full = float(self.tokens_per_minute)
        left, at = self._buckets.get(tenant, (full, now))
        level = min(full, left + (now - at) * self._rate)
        if level >= full and tenant not in self._live:
            self._buckets.pop(tenant, None)
        return level
