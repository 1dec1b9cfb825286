"""core.tenants.Tenants: the per-tenant limits, their retry delays, and bounded metric labels."""

from __future__ import annotations

import pytest

from core.errors import Overloaded
from core.tenants import DEFAULT_LABEL, OTHER_LABEL, Tenants


def test_running_limit_counts_queued_and_running_requests():
    t = Tenants(max_running=2)
    t.admit("a", 0.0)
    t.admit("a", 0.0)
    with pytest.raises(Overloaded) as e:
        t.admit("a", 0.0)
    assert e.value.reason == "TENANT_LIMIT" and e.value.retry_delay == 1.0 and "'a'" in e.value.message
    t.admit("b", 0.0)  # another tenant is not affected
    t.scheduled("a")
    t.ended("a", scheduled=True, prompt_tokens=3, generation_tokens=4, now=1.0)
    t.admit("a", 1.0)  # room again
    c = t.counts["a"]
    assert (c.waiting, c.running, c.prompt_tokens, c.generation_tokens, c.refusals) == (2, 0, 3, 4, 1)


def test_withdrawn_and_never_scheduled_requests_leave_no_count():
    t = Tenants(max_running=1)
    t.admit("", 0.0)
    t.withdraw("")
    t.admit("", 0.0)
    t.ended("", scheduled=False, prompt_tokens=0, generation_tokens=0, now=0.0)
    assert t.counts[DEFAULT_LABEL].waiting == 0
    t.admit("", 0.0)
    with pytest.raises(Overloaded, match="default tenant"):
        t.admit("", 0.0)


def test_tokens_per_minute_bucket_refills_and_names_the_wait():
    t = Tenants(tokens_per_minute=600)  # 10 tokens a second
    t.admit("a", 0.0)
    t.scheduled("a")
    t.ended("a", scheduled=True, prompt_tokens=100, generation_tokens=600, now=0.0)  # 100 in debt
    with pytest.raises(Overloaded) as e:
        t.admit("a", 1.0)  # 90 in debt: 9.1 s to get one token back
    assert e.value.retry_delay == 10.0
    t.admit("a", 11.0)  # refilled past zero
    assert t.counts["a"].refusals == 1


def test_full_buckets_of_idle_tenants_are_forgotten():
    t = Tenants(tokens_per_minute=60)
    for i in range(100):
        t.admit(f"t{i}", 0.0)
        t.ended(f"t{i}", scheduled=False, prompt_tokens=0, generation_tokens=0, now=0.0)
    assert not t._buckets and not t._live


def test_metric_labels_are_bounded():
    t = Tenants(max_labels=2)
    for name in ("a", "b", "c", "d"):
        t.refused(name)
    assert set(t.counts) == {"a", "b", OTHER_LABEL}
    assert t.counts[OTHER_LABEL].refusals == 2
    assert t.label("a") == "a" and t.label("zzz") == OTHER_LABEL


def test_negative_limits_are_refused():
    with pytest.raises(ValueError):
        Tenants(max_running=-1)
